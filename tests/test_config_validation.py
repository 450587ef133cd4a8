"""A config that refuses nonsense before any work: one line, `--flag=value: must ...`, naming
what is allowed (the sections' `rules` and `check`, models/config.py), and exit status 2 from
launch.py."""

import math
import os
import subprocess
import sys

import pytest

import configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN = float("nan")

# The values that used to be accepted silently, then more of the same kind.
REFUSED = [
    ("beta", 0.0), ("beta", -0.1), ("beta", NAN), ("learning_rate", -1e-3),
    ("sft_learning_rate", -1e-3), ("learning_rate", NAN), ("lora_alpha", -32.0),
    ("lora_alpha", 0.0), ("kl_spike_factor", -4.0), ("kl_spike_factor", 0.5),
    ("rollback_lr_factor", -0.1), ("rollback_lr_factor", NAN), ("max_grad_norm", -1.0),
    ("max_grad_norm", NAN), ("max_prompt_length", 0), ("max_target_length", 0), ("steps", 0),
    ("ld_alpha", 0.0), ("weight_decay", -0.1), ("adam_b1", 1.0), ("adam_b2", -0.5),
    ("kl_max", NAN), ("kl_spike_min", -1.0), ("warmup_ratio", NAN), ("d_model", 0),
    ("n_layers", 0), ("init_std", -0.02), ("norm_eps", 0.0), ("rope_theta", NAN),
    ("eval_split", 1.0), ("task_train_pairs", 0), ("eval_temperature", NAN),
    ("ref_update_alpha", 0.0), ("keep_checkpoints", 0), ("log_every", 0), ("lora_dropout", 1.0),
    ("sft_steps", 0),
    # Choices, and rules that read another field, in the same form.
    ("compute_dtype", "float16"), ("arch", "gpt2"), ("mlp_act", "relu"), ("rope_scaling", "yarn"),
    ("base_quant", "int4"), ("matmul_backward", "manual"), ("ref_update", "sometimes"),
    ("resume", "sometimes"), ("wandb_mode", "sometimes"), ("f_divergence", "kl"),
    ("stage", "sft,sft"), ("head_dim", 33), ("n_kv_heads", 3), ("logits_chunk", 7),
    ("gradient_accumulation_steps", 3), ("scan_unroll", 0),
]


@pytest.mark.parametrize("name,value", REFUSED, ids=[f"{n}={v}" for n, v in REFUSED])
def test_nonsense_is_refused_in_one_line(name, value):
  with pytest.raises(ValueError) as e:
    configs.DEFAULT.replace(**{name: value})
  message = str(e.value)
  assert "\n" not in message
  assert message.startswith(f"--{name}="), message
  nan = isinstance(value, float) and math.isnan(value)
  assert ("nan" in message if nan else repr(value) in message or str(value) in message), message
  assert "must" in message


def test_edges_that_mean_something_are_accepted():
  configs.DEFAULT.replace(max_grad_norm=0.0, kl_spike_factor=0.0, kl_max=0.0, weight_decay=0.0,
                          ld_alpha=1.0, lora_rank=0, stage="dpo", sft_steps=0, eval_split=0.0)


def test_launch_prints_one_line_and_exits_2():
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launch.py"), "--beta=nan"],
                     capture_output=True, text=True, timeout=120,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 2
  assert r.stderr.strip() == "error: --beta=nan: must be > 0", r.stderr


def test_remat_needs_the_layer_scan():
  """Unrolled layers would keep the activations remat frees, so the pair is refused by name;
  bench-small (which unrolls) takes --remat with --scan_unroll=1."""
  with pytest.raises(ValueError, match=r"--remat=True: must go with --scan_unroll=1, not 8"):
    configs.get_config("bench-small").replace(remat=True)
  assert configs.get_config("bench-small").replace(remat=True, scan_unroll=1).model.remat
  assert configs.get_config("bench-small").replace(remat=True, n_layers=1).model.remat  # no unroll


def test_a_field_name_two_sections_use_is_named_with_both():
  """A fork's section whose field clashes with a built-in one: the error names the field and both
  sections, not a bare assertion."""
  import dataclasses

  @dataclasses.dataclass(frozen=True)
  class Mine:
    beta: float = 0.2

  with pytest.raises(TypeError, match=r"'beta' is in two sections, loss \(LossConfig\) and "
                                      r"mine \(.*Mine\)"):
    configs._field_sections({"loss": configs.LossConfig, "mine": Mine})
