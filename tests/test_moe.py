"""models/moe.py: the mixture-of-experts MLP equals a dense reference that runs every expert on
every token and weights the chosen ones; its router's load-balancing loss equals transformers'
`load_balancing_loss_func`; a decoder with experts trains, decodes and shards."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import moe, sharding, transformer
from models.config import ModelConfig

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  mlp_dim=16, n_experts=6, experts_per_token=2, arch="qwen3_moe")


@pytest.fixture(scope="module")
def mesh1():
  return sharding.make_mesh("data:1", jax.devices()[:1])


def _inputs(B=2, T=12, seed=0, vocab=64):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (B, T)).astype(np.int32)
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
  return transformer.Inputs(tokens, positions, np.ones((B, T), np.int32))


def _dense_reference(cfg, x_ND, p):
  """Every expert on every token (numpy, float64), summed with the router's top-k weights,
  zero for the experts a token is not routed to."""
  x = np.asarray(x_ND, np.float64)
  logits = x @ np.asarray(p["router"], np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  top = np.argsort(-probs, axis=-1)[:, :cfg.experts_per_token]
  weights = np.zeros_like(probs)
  np.put_along_axis(weights, top, np.take_along_axis(probs, top, -1), -1)
  if cfg.router_norm_topk:
    weights /= weights.sum(-1, keepdims=True)
  silu = lambda v: v / (1 + np.exp(-v))
  g = np.einsum("nd,edf->nef", x, np.asarray(p["expert_gate"], np.float64))
  u = np.einsum("nd,edf->nef", x, np.asarray(p["expert_up"], np.float64))
  y = np.einsum("nef,efd->ned", silu(g) * u, np.asarray(p["expert_down"], np.float64))
  return np.einsum("ned,ne->nd", y, weights)


@pytest.mark.parametrize("norm_topk", [False, True])
@pytest.mark.parametrize("k", [1, 2, 6])
def test_dropless_dispatch_equals_every_expert_on_every_token(mesh1, norm_topk, k):
  """Sorted-by-expert ragged matmuls give what running all E experts densely gives, for top-1,
  top-2 and top-E (every expert chosen), with and without renormalised weights; its gradients
  equal the dense reference's (autodiff of the same reference in JAX)."""
  cfg = dataclasses.replace(CFG, router_norm_topk=norm_topk, experts_per_token=k)
  p = jax.tree.map(lambda x: x[0], transformer.init(cfg, jax.random.key(1), mesh1)["layers"])
  x_ND = jax.random.normal(jax.random.key(2), (40, cfg.d_model))
  w, e, _ = moe.route(cfg, x_ND, p["router"])
  got = moe.experts(x_ND, w, e, p, jax.nn.silu)
  np.testing.assert_allclose(got, _dense_reference(cfg, x_ND, p), rtol=2e-5, atol=2e-6)

  def dense(p, x):  # the reference in JAX, for its gradients
    w, e, _ = moe.route(cfg, x, p["router"])
    weights = jnp.zeros((x.shape[0], cfg.n_experts)).at[jnp.arange(x.shape[0])[:, None], e].set(w)
    h = jax.nn.silu(jnp.einsum("nd,edf->nef", x, p["expert_gate"])) * jnp.einsum(
        "nd,edf->nef", x, p["expert_up"])
    return jnp.einsum("nef,efd,ne->nd", h, p["expert_down"], weights)

  def sparse(p, x):
    w, e, _ = moe.route(cfg, x, p["router"])
    return moe.experts(x, w, e, p, jax.nn.silu)

  loss = lambda f: lambda p, x: jnp.sum(jnp.sin(f(p, x)))
  g_sparse = jax.grad(loss(sparse), argnums=(0, 1))(p, x_ND)
  g_dense = jax.grad(loss(dense), argnums=(0, 1))(p, x_ND)
  for a, b in zip(jax.tree.leaves(g_sparse), jax.tree.leaves(g_dense)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_an_expert_no_token_chooses_and_one_every_token_chooses(mesh1):
  """Empty groups and a group of all N tokens: the router biased so that every token picks
  expert 3 first and no token ever picks expert 0."""
  p = jax.tree.map(lambda x: x[0], transformer.init(CFG, jax.random.key(3), mesh1)["layers"])
  x_ND = jax.random.normal(jax.random.key(4), (16, CFG.d_model))
  x_ND = x_ND.at[:, 0].set(10.0)
  router = p["router"].at[0, 3].set(5.0).at[0, 0].set(-5.0)
  p = dict(p, router=router)
  w, e, _ = moe.route(CFG, x_ND, p["router"])
  assert (e[:, 0] == 3).all() and not (e == 0).any()
  np.testing.assert_allclose(moe.experts(x_ND, w, e, p, jax.nn.silu),
                             _dense_reference(CFG, x_ND, p), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
def test_router_logits_and_load_balancing_loss_equal_transformers(arch, mesh1, tmp_path):
  """A tiny random transformers model of each family, imported: every layer's router logits
  equal transformers' `output_router_logits` on a right-padded batch, and the auxiliary loss
  equals transformers' `load_balancing_loss_func` (padding masked out) and the `aux_loss` its
  forward returns, also from two parts' summed stats; expert load sums to 1 a layer; the z-loss
  is the mean squared log-sum-exp of the real tokens' logits."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from models import hf
  common = dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                tie_word_embeddings=False)
  config = {"qwen3_moe": lambda: transformers.Qwen3MoeConfig(**common, num_experts=6,
                                                              moe_intermediate_size=16),
            "mixtral": lambda: transformers.MixtralConfig(**common, num_local_experts=6),
            "olmoe": lambda: transformers.OlmoeConfig(**common, num_experts=6)}[arch]()
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.15 * torch.randn_like(p))
  model = model.float().eval()
  model.save_pretrained(tmp_path)
  cfg, params = hf.load(str(tmp_path), mesh1)
  B, T = 3, 10
  rng = np.random.default_rng(0)
  seg = (np.arange(T)[None] < np.array([T, 7, 4])[:, None]).astype(np.int32)
  tokens = rng.integers(1, 64, (B, T)).astype(np.int32) * seg
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
  _, router_LBTE = transformer.hidden_and_router(cfg, params, transformer.Inputs(tokens,
                                                                                 positions, seg))
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                attention_mask=torch.tensor(seg, dtype=torch.long), output_router_logits=True)
  theirs = np.stack([r.float().numpy().reshape(B, T, -1) for r in out.router_logits])
  real = seg.astype(bool)
  np.testing.assert_allclose(np.asarray(router_LBTE)[:, real], theirs[:, real], atol=2e-5)
  module = __import__(type(model).__module__, fromlist=["load_balancing_loss_func"])
  want = module.load_balancing_loss_func(out.router_logits, cfg.n_experts, cfg.experts_per_token,
                                         torch.tensor(seg)).item()
  stats = moe.router_stats(router_LBTE, seg, cfg.experts_per_token)
  np.testing.assert_allclose(float(moe.load_balancing_loss(stats)), want, rtol=1e-5)
  np.testing.assert_allclose(float(moe.load_balancing_loss(stats)), out.aux_loss.item(), rtol=1e-5)
  # a pair's two sides: their summed stats are the concatenated forward's (TRL's layout)
  halves = [moe.router_stats(router_LBTE[:, rows], seg[rows], cfg.experts_per_token)
            for rows in (slice(0, 1), slice(1, 3))]
  np.testing.assert_allclose(float(moe.load_balancing_loss(moe.combine(*halves))), want,
                             rtol=1e-5)
  np.testing.assert_allclose(np.asarray(moe.expert_load(stats)).sum(-1), 1.0, rtol=1e-6)
  z = np.log(np.exp(theirs[:, real].astype(np.float64)).sum(-1)) ** 2
  np.testing.assert_allclose(float(moe.z_loss(stats)), z.mean(), rtol=1e-5)


def _tiny_qwen3_moe(tmp_path, vocab=264):
  """A random transformers Qwen3-MoE saved to `tmp_path` (its weights perturbed off init)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config = transformers.Qwen3MoeConfig(
      vocab_size=vocab, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
      num_experts_per_tok=2, moe_intermediate_size=16, tie_word_embeddings=False)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.15 * torch.randn_like(p))
  model.float().save_pretrained(tmp_path)
  return torch, transformers


@pytest.mark.parametrize("prefix_sharing", [False, True])
def test_dpo_step_adds_trls_router_aux_loss(mesh1, tmp_path, prefix_sharing):
  """The DPO step's loss with --router_aux_loss_coef=c is its loss without plus c times the
  policy's load-balancing loss, which on unshared rows is transformers' `aux_loss` of chosen and
  rejected concatenated (TRL's `concatenated_forward`), the policy being the base with its LoRA
  merged (the export, loaded by transformers); shared-prefix rows count each prompt once."""
  import configs
  from dpo import data, task, train
  from dpo.batches import PairBatch
  from dpo.tokenizer import ByteTokenizer
  from models import hf, lora as lora_lib
  torch, transformers = _tiny_qwen3_moe(tmp_path / "base")
  model_cfg, base = hf.load(str(tmp_path / "base"), mesh1)
  fields = {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(model_cfg)}
  fields["prefix_sharing"] = prefix_sharing
  cfg = configs.DEFAULT.replace(
      **fields, lora_targets=("q", "v"), lora_dropout=0.0, rpo_alpha=0.0, global_batch_size=4)
  pairs = data.tokenize_pairs(task.preference_records(4, 0), ByteTokenizer(), 16, 12)
  if prefix_sharing:
    from dpo import packing
    pairs = {**pairs, **packing.shared_prefix(pairs)[0]}
  batch = train.device_batch(mesh1, PairBatch.of(pairs))
  lora = lora_lib.init(cfg.model, cfg.lora, jax.random.key(1), mesh1)
  lora = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape), lora)
  frozen = train.initial_frozen(base)
  loss = {}
  for c in (0.0, 0.25):
    spec = train.StepConfig.dpo(cfg.replace(router_aux_loss_coef=c))
    loss[c], metrics = train.microbatch_loss(spec, frozen, lora, batch, None)
  hf.save(str(tmp_path / "policy"), cfg.model, base, hf.Lora(lora, cfg.lora))
  policy = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "policy", attn_implementation="eager", dtype=torch.float32).eval()
  if prefix_sharing:  # one row a pair: its segment marks prompt and both completions
    tokens, mask = pairs["shared_tokens"], pairs["shared_segment_ids"] != 0
    got = float(metrics["router_aux_loss"])
    _, router = transformer.hidden_and_router(
        cfg.model, base, transformer.Inputs(tokens, pairs["shared_positions"],
                                            pairs["shared_segment_ids"], pairs["shared_branch"]),
        transformer.Adapter(lora, cfg.lora.scale))
    want = float(moe.load_balancing_loss(moe.router_stats(router, mask, 2)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
  else:
    tokens = np.concatenate([pairs["tokens"][:, 0], pairs["tokens"][:, 1]])
    mask = np.concatenate([pairs["segment_ids"][:, 0], pairs["segment_ids"][:, 1]]) != 0
    with torch.no_grad():
      out = policy(input_ids=torch.tensor(tokens, dtype=torch.long),
                   attention_mask=torch.tensor(mask, dtype=torch.long), output_router_logits=True)
    want = out.aux_loss.item()
    np.testing.assert_allclose(float(metrics["router_aux_loss"]), want, rtol=1e-4)
  np.testing.assert_allclose(float(loss[0.25]) - float(loss[0.0]), 0.25 * want, rtol=1e-4,
                             atol=1e-6)


def test_cached_greedy_decoding_with_experts_matches_full_recompute(mesh1):
  """The sampler's KV-cache decode runs the experts token by token (groups of one row): its
  greedy tokens equal those of re-running the whole forward at every step."""
  from models import sampler
  cfg = dataclasses.replace(CFG, vocab_size=40, init_std=0.3)
  params = transformer.init(cfg, jax.random.key(5), mesh1)
  prompts = [[1, 3, 4, 5], [1, 7], [1, 2, 9, 9, 9, 4]]
  n = 6
  scfg = sampler.SamplingConfig(max_new_tokens=n, eos_id=39, pad_id=0, temperature=0.0,
                                vocab_limit=38, banned_ids=(0,))
  tokens, segments = sampler.left_pad(prompts, 0, 1)
  out = jax.device_get(sampler.generate(cfg, scfg, params, sampler.Prompts(
      jnp.asarray(tokens), jnp.asarray(segments)), jax.random.key(0)))
  fwd = jax.jit(lambda t, p, s: transformer.forward(cfg, params, transformer.Inputs(t, p, s)))
  for b, prompt in enumerate(prompts):
    seq = list(prompt)
    for _ in range(n):
      T = len(seq)
      logits = np.array(fwd(np.array([seq], np.int32), np.arange(T, dtype=np.int32)[None],
                            np.ones((1, T), np.int32)))[0, -1]
      logits[38:] = -np.inf
      logits[0] = -np.inf
      seq.append(int(np.argmax(logits)))
    assert out.tokens[b].tolist() == seq[len(prompt):], b
  assert len(np.unique(out.tokens)) > 3


@pytest.mark.slow
def test_a_tiny_moe_run_logs_its_router_figures(tmp_path):
  """sft then dpo then grpo with experts and both router losses: every stage's metrics carry the
  load-balancing loss, the z-loss and the busiest expert's load, and the run ends in a verdict;
  a recipe with a stage that adds no router loss is refused in one line naming the flags."""
  import json

  import configs
  from dpo import loop
  cfg = configs.get_config("moe").replace(
      d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=32,
      task_sft_examples=64, task_train_pairs=64, task_eval_pairs=16, task_eval_prompts=8,
      sft_steps=4, steps=2, grpo_steps=2, num_generations=4, global_batch_size=8,
      max_completion_length=8, eval_max_new_tokens=8, log_every=1, checkpoint_every=2,
      stage="sft,dpo,grpo", router_aux_loss_coef=0.01, router_z_loss_coef=0.001,
      output_dir=str(tmp_path / "run"))
  summary = loop.run(cfg)
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    rows = [json.loads(l) for l in f]
  for stage in ("sft", "dpo", "grpo"):
    mine = [r for r in rows if r.get("stage") == stage and "loss" in r]
    assert mine and all(r["router_aux_loss"] >= 1.0 - 1e-6 and r["router_z_loss"] > 0 and
                        1.0 <= r["expert_load_max"] <= cfg.model.n_experts for r in mine), stage
  assert summary["verdicts"] and (tmp_path / "run" / "curves.png").stat().st_size > 10_000
  from dpo import curves  # the router's panels, a line for each stage
  drawn = dict(curves.layout(rows))
  for name, key in curves.ROUTER:
    assert [stage for stage, *_ in drawn[name]] == ["dpo", "grpo", "sft"], name
  assert not any(name in dict(curves.layout([r for r in rows if "router_aux_loss" not in r]))
                 for name, _ in curves.ROUTER)
  with pytest.raises(ValueError, match="router_aux_loss_coef=0.01.*the rm stage adds no router"):
    configs.get_config("moe").replace(stage="sft,rm,dpo", router_aux_loss_coef=0.01)


def test_moe_dpo_steps_do_not_depend_on_the_mesh():
  """Two DPO steps with experts and the router's losses on 1 device and on
  data:2,fsdp:2,tensor:2 (the experts' matrices split over fsdp and tensor, the batch over data
  and fsdp): the same losses, router losses and gradient norms to float tolerance."""
  import configs
  from dpo import data, task, train
  from dpo.batches import PairBatch
  from dpo.tokenizer import ByteTokenizer
  from models import lora as lora_lib
  cfg = configs.get_config("moe").replace(
      d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=16, mlp_dim=32, lora_rank=16,
      global_batch_size=8, learning_rate=1e-2, router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
  pairs = data.tokenize_pairs(task.preference_records(8, 0), ByteTokenizer(), 24, 24)
  runs = {}
  for spec, n in (("data:1", 1), ("data:2,fsdp:2,tensor:2", 8)):
    mesh = sharding.make_mesh(spec, jax.devices()[:n])
    base = transformer.init(cfg.model, jax.random.key(0), mesh)
    step_cfg = train.StepConfig.dpo(cfg)
    state = train.init_state(lora_lib.init(cfg.model, cfg.lora, jax.random.key(1), mesh),
                             step_cfg.optimizer()[0], 0, mesh)
    frozen = train.initial_frozen(base)
    step = train.jit_step(train.dpo_step, step_cfg, mesh, state, frozen)
    batch = train.device_batch(mesh, PairBatch.of(pairs))
    runs[spec] = []
    for _ in range(2):
      state, m = step(state, frozen, batch)
      runs[spec].append({k: float(m[k]) for k in ("loss", "router_aux_loss", "router_z_loss",
                                                  "grad_norm")})
  for a, b in zip(runs["data:1"], runs["data:2,fsdp:2,tensor:2"]):
    for key in ("loss", "router_aux_loss", "router_z_loss"):
      np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=2e-6, err_msg=key)
    np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=1e-4)


def test_router_loss_coefficients_need_experts(tmp_path):
  """--router_aux_loss_coef without experts is refused at once; with --init_from=hf:DIR the
  import decides: a dense model refused by name after it, a mixture's accepted."""
  import configs
  from dpo import loop
  with pytest.raises(ValueError, match="a router's losses need experts"):
    configs.DEFAULT.replace(router_aux_loss_coef=0.01)
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config = transformers.LlamaConfig(vocab_size=264, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, tie_word_embeddings=False)
  torch.manual_seed(0)
  transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
  cfg = configs.DEFAULT.replace(
      init_from=f"hf:{tmp_path / 'llama'}", router_aux_loss_coef=0.01, stage="dpo", steps=1,
      lora_targets=("q", "v"), task_train_pairs=16, task_eval_pairs=8, task_eval_prompts=4,
      output_dir=str(tmp_path / "run"))
  with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.01.*the llama model of "
                                       r"--init_from=.* has no experts"):
    loop.run(cfg)
