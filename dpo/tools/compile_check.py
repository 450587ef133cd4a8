"""Compile the DPO train step for a real-size model from abstract shapes; print per-device memory.

    python -m dpo.compile_check --config=llama3-8b --mesh=fsdp:8
    python -m dpo.compile_check --config=llama3-8b --mesh=fsdp:4,tensor:2 --fake_devices=8

No weights are allocated: parameters, LoRA factors, optimizer state and the batch are
`jax.ShapeDtypeStruct`s carrying the shardings training would use, and the step is lowered and
compiled for a mesh of fake CPU devices. The compiler's memory analysis then says what one device
holds (arguments, outputs, temporaries), which checks that the sharding of a real size fits
before any accelerator is involved. CPU temporaries approximate, not equal, what an accelerator
backend schedules. Any config flag of launch.py applies (e.g. --global_batch_size, --lora_rank).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import Config
from dpo import train
from models import lora as lora_lib
from models import sharding, transformer


def _with_sharding(abstract_tree, sharding_tree):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract_tree, sharding_tree)


def abstract_dpo_inputs(cfg: Config, mesh, seq_len: int) -> tuple[Any, Any, Any, tuple]:
  """(state, frozen, batch) as sharded ShapeDtypeStructs, plus (opt, sched).

  frozen is the base (LoRA on) or the reference copy (LoRA off, same shapes as the policy).
  """
  opt, sched = train.optimizer(cfg, cfg.train.learning_rate, max(cfg.train.steps, 1))
  specs = transformer.param_specs(cfg.model)
  frozen = _with_sharding(transformer.abstract(specs), transformer.shardings(specs, mesh))
  if cfg.lora.enabled:
    lspecs = lora_lib.lora_specs(cfg.model, cfg.lora)
    trainable = _with_sharding(transformer.abstract(lspecs), transformer.shardings(lspecs, mesh))
  else:
    trainable = frozen
  train_sh = jax.tree.map(lambda x: x.sharding, trainable)
  opt_state = _with_sharding(jax.eval_shape(opt.init, trainable),
                             train.opt_state_shardings(opt, trainable, train_sh, mesh))
  rep = NamedSharding(mesh, P())
  scalar = lambda dtype, shape=(): jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
  state = train.TrainState(step=scalar(jnp.int32), params=trainable, opt_state=opt_state,
                           rng=scalar(jnp.uint32, (2,)), lr_scale=scalar(jnp.float32),
                           skipped=scalar(jnp.int32))
  shape = (cfg.train.global_batch_size, 2, seq_len)
  bsh = train.batch_sharding(mesh)
  batch = {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=bsh),
           "positions": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=bsh),
           "segment_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=bsh),
           "loss_mask": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=bsh)}
  return state, frozen, batch, (opt, sched)


def compile_dpo_step(cfg: Config, mesh, seq_len: int | None = None):
  """Lowers and compiles the jitted DPO step from abstract inputs; returns the Compiled object."""
  seq_len = seq_len or cfg.data.max_prompt_length + cfg.data.max_target_length
  state, frozen, batch, (opt, sched) = abstract_dpo_inputs(cfg, mesh, seq_len)
  state_sh = jax.tree.map(lambda x: x.sharding, state)
  frozen_sh = jax.tree.map(lambda x: x.sharding, frozen)
  step = train.jit_step_with_shardings(train.dpo_step, cfg, opt, sched, mesh, state_sh,
                                       frozen_sh)
  return step.lower(state, frozen, batch).compile()


def memory_report(compiled) -> dict[str, int]:
  """Per-device bytes from the compiler. peak ~ arguments + outputs + temporaries - aliased
  (donated state reuses its input buffers)."""
  m = compiled.memory_analysis()
  out = {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
         "temporaries": int(m.temp_size_in_bytes), "aliased": int(m.alias_size_in_bytes),
         "generated_code": int(m.generated_code_size_in_bytes)}
  out["peak_estimate"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
  return out


def main(argv) -> None:
  del argv
  import launch
  cfg = launch.config_from_flags()
  mesh = sharding.make_mesh(cfg.train.mesh)
  seq_len = cfg.data.max_prompt_length + cfg.data.max_target_length
  opt, _ = train.optimizer(cfg, cfg.train.learning_rate, max(cfg.train.steps, 1))
  est = train.memory_estimate(cfg, mesh, opt)
  specs = transformer.param_specs(cfg.model)
  n = transformer.num_params(transformer.abstract(specs))
  print(f"config {FLAGS.config}: {n / 1e9:.2f}B parameters, mesh {dict(mesh.shape)}, "
        f"batch {cfg.train.global_batch_size} pairs x 2 x {seq_len} tokens, "
        f"compute {cfg.model.compute_dtype}, remat {cfg.model.remat}, "
        f"LoRA rank {cfg.lora.lora_rank}")
  dropped = sharding.replicated_axes(specs, mesh)
  if dropped:
    print(f"replicated because the mesh axis does not divide the dimension: {dropped}")
  gib = lambda b: f"{b / 2**30:.3f} GiB"
  print("estimate per device: " + ", ".join(f"{k} {gib(v)}" for k, v in est.items()))
  compiled = compile_dpo_step(cfg, mesh, seq_len)
  rep = memory_report(compiled)
  print("compiler per device: " + ", ".join(f"{k} {gib(v)}" for k, v in rep.items()))


def _main_with_devices(argv) -> None:
  if FLAGS.fake_devices:  # before anything touches a device
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", FLAGS.fake_devices)
  main(argv)


if __name__ == "__main__":
  import launch  # defines the config flags (--config, --mesh, every config field)
  from absl import app, flags

  flags.DEFINE_integer("fake_devices", 8, "Fake CPU devices to compile for (0: use real devices).")
  FLAGS = flags.FLAGS
  app.run(_main_with_devices)
