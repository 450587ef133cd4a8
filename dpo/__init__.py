"""DPO: data, log-probs, losses, the train step and the loop."""
