"""The same run on any mesh: dropout and sampling do not depend on how the batch is sharded, so
1 device, 8 data-parallel devices and a 3-axis mesh give the same losses to float tolerance."""

import json

import jax
import numpy as np
import pytest

import configs
from dpo import loop
from models import sharding

MESHES = {"1 device": ("data:1", 1), "data:8": ("data:8", 8),
          "data:2,fsdp:2,tensor:2": ("data:2,fsdp:2,tensor:2", 8)}


def _run(tmp_path, name: str) -> tuple[list[dict], dict]:
  spec, n = MESHES[name]
  out = tmp_path / name.replace(" ", "_").replace(",", "_").replace(":", "")
  # DPO from the random base (the SFT stage is the same step without LoRA dropout).
  cfg = configs.DEFAULT.replace(
      stage="dpo", steps=6, log_every=1, eval_every=0, checkpoint_every=0, output_dir=str(out),
      task_train_pairs=64, task_sft_examples=64, task_eval_pairs=16, task_eval_prompts=8,
      eval_max_new_tokens=16, max_prompt_length=24, max_target_length=40)
  summary = loop.run(cfg, mesh=sharding.make_mesh(spec, jax.devices()[:n]))
  return [json.loads(l) for l in open(out / "metrics.jsonl")], summary


@pytest.mark.slow
def test_losses_and_samples_do_not_depend_on_the_mesh(tmp_path):
  runs = {name: _run(tmp_path, name) for name in MESHES}
  base_records, base_summary = runs["1 device"]
  for name, (records, summary) in runs.items():
    assert [(r["stage"], r["step"]) for r in records] == [
        (r["stage"], r["step"]) for r in base_records], name
    for r, b in zip(records, base_records):
      if r["stage"] == "dpo":  # LoRA dropout is on (0.05): the same masks on every mesh
        np.testing.assert_allclose(r["loss"], b["loss"], rtol=2e-5, atol=2e-6, err_msg=name)
        np.testing.assert_allclose(r["grad_norm"], b["grad_norm"], rtol=1e-4, err_msg=name)
    # Sampling keys do not depend on the mesh either: the same evaluation samples.
    assert summary["win_rate"] == base_summary["win_rate"], name
    np.testing.assert_allclose(summary["kl_per_token"], base_summary["kl_per_token"], rtol=1e-3,
                               atol=1e-5, err_msg=name)
