"""TR-DPO: the soft update mixes weights (for LoRA the adapter products, kept exactly); the moving
reference is checkpointed, so resume and rollback are bitwise exact."""

import jax
import numpy as np
import pytest

import configs
import records
from dpo import checkpoint, loop, reference, train
from faults import Crash, LrSpike, Recorder, SimulatedCrash
from models import lora as lora_lib
from models import sharding

TINY = dict(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
            max_prompt_length=16, max_target_length=16, task_train_pairs=64,
            task_sft_examples=64, task_eval_pairs=0, task_eval_prompts=0, global_batch_size=8,
            log_every=1, stage="dpo", steps=8, checkpoint_every=2, keep_checkpoints=5,
            ref_update="soft", ref_update_alpha=0.3, ref_update_every=2)


# A persistent compilation cache for the tiny programs these tests rerun (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("compile_cache")


def tiny_cfg(out, **kw):
  return configs.DEFAULT.replace(**{**TINY, "output_dir": str(out), **kw})


def _random_adapter(cfg, mesh, seed):
  """LoRA factors with both A and B non-zero (a fresh adapter has B = 0, which hides errors)."""
  like = lora_lib.init(cfg.model, cfg.lora, jax.random.key(seed), mesh)
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jax.device_put(rng.normal(size=x.shape).astype(np.float32),
                                               x.sharding), like)


def _dense(adapter, scale):
  """{target: scale * A @ B} in numpy, [L, d_in, d_out]."""
  out = {}
  for name, f in adapter["layers"].items():
    a, b = np.asarray(f["a"], np.float64), np.asarray(f["b"], np.float64)
    L, R = a.shape[0], a.shape[-1]
    out[name] = scale * np.einsum("lir,lro->lio", a.reshape(L, -1, R), b.reshape(L, R, -1))
  return out


def test_soft_update_mixes_the_adapter_products_exactly():
  cfg = tiny_cfg("/tmp/unused", lora_rank=4, lora_alpha=24.0, lora_targets=("q", "v", "down"))
  mesh = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  s, alpha = cfg.lora.scale, cfg.reference.ref_update_alpha
  ref0, pol1, pol2 = (_random_adapter(cfg, mesh, k) for k in (1, 2, 3))
  frozen = train.initial_frozen(None, ref0)
  state = lambda p: train.TrainState(None, p, None, None, None, None)
  want = _dense(ref0, s)
  for k, pol in ((2, pol1), (4, pol2)):
    frozen = reference.maybe_update(cfg.reference, k, state(pol), frozen)
    want = {n: alpha * d + (1 - alpha) * want[n] for n, d in _dense(pol, s).items()}
    got = _dense(frozen.ref_lora, s)
    for n in want:
      np.testing.assert_allclose(got[n], want[n], rtol=1e-5, atol=1e-5, err_msg=n)
  # The old factor-wise mix (alpha * A_p + (1 - alpha) * A_r, same for B) is far from it.
  fac = jax.tree.map(lambda p, r: alpha * np.asarray(p) + (1 - alpha) * np.asarray(r), pol1, ref0)
  exact = {n: alpha * d + (1 - alpha) * _dense(ref0, s)[n] for n, d in _dense(pol1, s).items()}
  assert max(np.abs(_dense(fac, s)[n] - exact[n]).max() for n in exact) > 0.1
  assert jax.tree.leaves(frozen.ref_lora)[0].shape[-1] == 3 * 4  # two soft updates: 3 adapters
  hard = reference.maybe_update(cfg.replace(ref_update="hard").reference, 6, state(pol1), frozen)
  for got, new in zip(jax.tree.leaves(hard.ref_lora), jax.tree.leaves(pol1)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(new))


def _records(out):
  return records.metrics(out)


def _policy(out):
  cfg = tiny_cfg(out)
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  return checkpoint.load_params(str(out / "checkpoints" / "policy"), cfg.model, mesh)


@pytest.mark.parametrize("lora_rank", [4, 0])
@pytest.mark.slow
def test_resume_with_ref_update_is_bitwise(tmp_path, lora_rank):
  whole, cut = tmp_path / "whole", tmp_path / "cut"
  loop.run(tiny_cfg(whole, lora_rank=lora_rank))
  with pytest.raises(SimulatedCrash):
    loop.run(tiny_cfg(cut, lora_rank=lora_rank), extra_hooks={"dpo": [Crash(5)]})
  loop.run(tiny_cfg(cut, lora_rank=lora_rank))  # resumes at step 4, reference of step 4
  assert _records(cut) == _records(whole)
  for a, b in zip(jax.tree.leaves(_policy(cut)), jax.tree.leaves(_policy(whole))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  if lora_rank:
    meta = checkpoint.read_meta(str(cut / "checkpoints" / "dpo" / "step_00000004"))
    # Updates at steps 2 and 4 stacked two adapters; the hook's state is under its own key.
    assert meta["hook_states"]["UpdateReference"]["ref_rank"] == 3 * lora_rank


def test_rollback_restores_the_reference_of_its_checkpoint(tmp_path):
  """The spike's update at step 5 reaches the reference at step 6 before the spike is read; the
  rollback to step 4 must bring back step 4's reference: the replayed step 5 is bitwise the
  first one."""
  seen = Recorder()
  loop.run(tiny_cfg(tmp_path, lora_rank=4, kl_max=1e-3, kl_spike_factor=0.0),
           extra_hooks={"dpo": [LrSpike(5), seen]})
  events = [r for r in _records(tmp_path) if r.get("event") == "rollback"]
  assert len(events) == 1 and events[0]["to_step"] == 4
  steps = [s for s, _ in seen.seen]
  assert steps[:6] == [1, 2, 3, 4, 5, 5]
  first, again = seen.seen[4][1], seen.seen[5][1]
  for k in ("loss", "kl", "rewards/margins", "rewards/chosen"):
    assert again[k] == first[k], k
