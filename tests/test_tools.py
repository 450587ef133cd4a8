"""The tools of dpo/tools/: the compile-only check in process, and each tool run once as a user
runs it (`python -m dpo.tools.NAME`, tiny settings).

Compile-only check: the compiler's own per-device argument size must equal what the sharding
rules predict, which verifies that weights, LoRA factors and optimizer state really are split as
the rules say.
"""

import math

import configs
from dpo import train
from dpo.tools import compile_check
from models import sharding, transformer


def _expected_argument_bytes(cfg, mesh, seq_len):
  est = train.memory_estimate(train.StepConfig.dpo(cfg), mesh)
  rows = cfg.optim.global_batch_size // math.prod(mesh.shape[a] for a in sharding.RULES["batch"])
  batch = 4 * rows * 2 * seq_len * 4  # tokens, positions, segment ids (int32), loss mask (f32)
  scalars = 4 + 8 + 4 + 4  # step, rng key data (2 x uint32), lr_scale, skipped
  return est, est["total"] + batch + scalars


def test_bench_small_compiles_abstractly_with_predicted_per_device_memory():
  cfg = configs.get_config("bench-small").replace(global_batch_size=8)
  mesh = sharding.make_mesh("fsdp:4,tensor:2")
  seq_len = 64
  compiled = compile_check.compile_dpo_step(cfg, mesh, seq_len)
  rep = compile_check.memory_report(compiled)
  est, expected = _expected_argument_bytes(cfg, mesh, seq_len)
  assert rep["arguments"] == expected
  # The whole train state is donated: its buffers are reused for the new state.
  assert rep["aliased"] >= est["trainable"] + est["optimizer"]
  # Every matrix is split 8 ways (fsdp x tensor); only norms are replicated.
  specs = transformer.param_specs(cfg.model)
  full = 4 * transformer.num_params(transformer.abstract(specs))
  assert full / 8 <= est["frozen"] < full / 8 * 1.01
  assert rep["temporaries"] > 0


def test_llama3_8b_preset_is_the_published_shape():
  m = configs.get_config("llama3-8b").model
  n = transformer.num_params(transformer.abstract(transformer.param_specs(m)))
  # Llama 3.1 8B: 8,030,261,248 parameters (Meta's model card: "8B"); computed independently
  # from the published dimensions: embed + lm_head + 32 x (attention + MLP + 2 norms) + norm.
  per_layer = 4096 * (32 * 128 + 2 * 8 * 128) + 32 * 128 * 4096 + 3 * 4096 * 14336 + 2 * 4096
  assert n == 2 * 128256 * 4096 + 32 * per_layer + 4096 == 8_030_261_248
