"""Compile the DPO train step for a real-size model from abstract shapes; print per-device memory.

    python -m dpo.tools.compile_check --config=llama3-8b --mesh=fsdp:8
    python -m dpo.tools.compile_check --config=llama3-8b --mesh=fsdp:4,tensor:2 --fake_devices=8
    python -m dpo.tools.compile_check --config=llama3-8b --topology=v5e-16 --mesh=fsdp:-1

With --topology the step is compiled ahead of time for a TPU slice that need not be attached
(`jax.experimental.topologies`; needs libtpu, so on a TPU host): the memory is then what the
TPU compiler reports one chip of that slice holds, the attention the Pallas kernel's.

No weights are allocated: parameters, LoRA factors, optimizer state and the batch are
`jax.ShapeDtypeStruct`s carrying the shardings training would use, and the step a run jits
(`train.jit_step_with_shardings`) is lowered and compiled for a mesh of fake CPU devices. The
compiler's memory analysis then says what one device holds (arguments, outputs, temporaries),
which checks that the sharding of a real size fits before any accelerator is involved. CPU
temporaries approximate, not equal, what an accelerator backend schedules. Every config flag
applies (e.g. --global_batch_size, --lora_rank); --fake_devices is this tool's own.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.sharding import NamedSharding, PartitionSpec as P

import configs
from dpo import batches, cli, train
from models import sharding, transformer

FLAGS = flags.FLAGS


def _with_sharding(abstract_tree, sharding_tree):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract_tree, sharding_tree)


def _abstract(specs, mesh):
  return _with_sharding(transformer.abstract(specs), transformer.shardings(specs, mesh))


def abstract_dpo_inputs(cfg: configs.Config, mesh, seq_len: int) -> tuple[Any, Any, Any]:
  """(state, frozen, batch) of the DPO stage as sharded ShapeDtypeStructs.

  frozen is the base (LoRA on) or the reference copy (LoRA off, same shapes as the policy).
  """
  if cfg.model.base_quant != "none":
    raise ValueError(f"compile_check models a float base only, got --base_quant="
                     f"{cfg.model.base_quant}")
  opt, _ = train.StepConfig.dpo(cfg).optimizer()
  frozen = train.initial_frozen(_abstract(transformer.param_specs(cfg.model), mesh))
  trainable = _abstract(train.trainable_specs(cfg.model, cfg.lora), mesh)
  train_sh = jax.tree.map(lambda x: x.sharding, trainable)
  opt_state = _with_sharding(jax.eval_shape(opt.init, trainable),
                             train.opt_state_shardings(opt, trainable, train_sh, mesh))
  rep = NamedSharding(mesh, P())
  scalar = lambda dtype, shape=(): jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
  state = train.TrainState(step=scalar(jnp.int32), params=trainable, opt_state=opt_state,
                           rng=scalar(jnp.uint32, (2,)), lr_scale=scalar(jnp.float32),
                           skipped=scalar(jnp.int32))
  shape = (cfg.optim.global_batch_size, 2, seq_len)
  bsh = train.batch_sharding(mesh)
  dtypes = {"tokens": jnp.int32, "positions": jnp.int32, "segment_ids": jnp.int32,
            "loss_mask": jnp.float32}
  batch = batches.PairBatch(batches.Rows.of(
      {k: jax.ShapeDtypeStruct(shape, d, sharding=bsh) for k, d in dtypes.items()}))
  return state, frozen, batch


def compile_dpo_step(cfg: configs.Config, mesh, seq_len: int | None = None):
  """Lowers and compiles the jitted DPO step from abstract inputs; returns the Compiled object."""
  seq_len = seq_len or cfg.data.max_prompt_length + cfg.data.max_target_length
  state, frozen, batch = abstract_dpo_inputs(cfg, mesh, seq_len)
  shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
  step = train.jit_step_with_shardings(train.dpo_step, train.StepConfig.dpo(cfg), mesh,
                                       shardings(state), shardings(frozen))
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


# TPU slices by their Cloud TPU names: the topology libtpu's compiler takes, the chip
# configuration and the chips a host holds (as MaxText's accelerator_to_spec_map names them).
TOPOLOGIES = {
    "v4-8": ("v4:2x2x1", "megacore", (2, 2, 1)),
    "v5e-16": ("v5e:4x4", "default", (2, 2, 1)),
    "v5e-256": ("v5e:16x16", "default", (2, 2, 1)),
}


def topology_devices(name: str) -> list:
  """The devices of a TPU slice that need not be attached, to compile for ahead of time."""
  from jax.experimental import topologies
  topology, chip_config, per_host = TOPOLOGIES[name]
  try:
    return topologies.get_topology_desc(topology_name=topology, platform="tpu",
                                        chip_config_name=chip_config,
                                        chips_per_host_bounds=per_host, num_slices=1).devices
  except Exception as e:  # no libtpu here, or this libtpu does not know the slice
    raise app.UsageError(f"--topology={name}: cannot describe the TPU slice {topology} here "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                         "run on a host with libtpu (jax[tpu])") from None


def main(argv) -> None:
  del argv
  devices = None
  if FLAGS.topology:
    if FLAGS["fake_devices"].present:
      raise app.UsageError("--fake_devices: give it or --topology, not both")
    devices = topology_devices(FLAGS.topology)
  elif FLAGS.fake_devices:  # before anything touches a device
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", FLAGS.fake_devices)
  cfg = cli.from_flags()
  mesh = sharding.make_mesh(cfg.mesh.mesh, devices)
  seq_len = cfg.data.max_prompt_length + cfg.data.max_target_length
  est = train.memory_estimate(train.StepConfig.dpo(cfg), mesh)
  specs = transformer.param_specs(cfg.model)
  n = transformer.num_params(transformer.abstract(specs))
  target = (f"{FLAGS.topology} ({len(devices)} x {devices[0].device_kind}, ahead of time)"
            if devices else f"{jax.device_count()} x {jax.devices()[0].platform}")
  print(f"config {FLAGS.config}: {n / 1e9:.2f}B parameters, compiled for {target}, "
        f"mesh {dict(mesh.shape)}, "
        f"batch {cfg.optim.global_batch_size} pairs x 2 x {seq_len} tokens, "
        f"compute {cfg.model.compute_dtype}, remat {cfg.model.remat}, "
        f"LoRA rank {cfg.lora.lora_rank}")
  dropped = sharding.replicated_axes(specs, mesh)
  if dropped:
    print(f"replicated because the mesh axis does not divide the dimension: {dropped}")
  gib = lambda b: f"{b / 2**30:.3f} GiB"
  print("estimate per device: " + ", ".join(f"{k} {gib(v)}" for k, v in est.items()))
  rep = memory_report(compile_dpo_step(cfg, mesh, seq_len))
  print("compiler per device: " + ", ".join(f"{k} {gib(v)}" for k, v in rep.items()))


if __name__ == "__main__":
  cli.define_flags()
  flags.DEFINE_integer("fake_devices", 8, "Fake CPU devices to compile for (0: use real devices).")
  flags.DEFINE_enum("topology", "", ["", *TOPOLOGIES], "A TPU slice to compile for ahead of "
                    "time instead (needs libtpu: a TPU host), not with --fake_devices.")
  app.run(main)
