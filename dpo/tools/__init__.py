"""Benchmarks and one-off checks, apart from the library; each runs as `python -m dpo.tools.NAME`.

Every tool takes absl flags: those that read a config take `--config` and every config field
(dpo.cli.define_flags), plus a few flags of their own.

  bench                 DPO step time, pairs/s, tokens/s and utilisation (bench-small workload)
  bench_precompute_ref  the run's jitted DPO step with the reference forward vs precomputed log-probs
  compare_losses        one SFT model, then one DPO run per loss type; held-out metrics per loss
  compile_check         compile the DPO step from abstract shapes; per-device memory, no weights
  base_memory           frozen-base bytes of the real-size presets: float32, bfloat16, int8, nf4
  curves                a run's metrics.jsonl as one PNG page of curves
  frontier              reward-KL frontier: DPO over betas, Preferred-FT, best-of-N (table, PNG),
                        under the embedded task's true reward or any judge (--judge, --reward_fn)
  generate              a model's answers to AlpacaEval / MT-Bench questions, in the files their
                        judges read (model_outputs.json, FastChat answer JSONL)

Nothing in dpo/ or models/ imports these modules or launch.py.
"""
