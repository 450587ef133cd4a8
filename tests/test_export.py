"""--export_hf end to end (dpo/loop.py `_export`, models/hf.py): a run from `--init_from=hf:DIR`
with a Hugging Face tokenizer folder, SFT then DPO with LoRA, exports a folder that transformers
and PEFT load with no edits. Checked with transformers and PEFT themselves: the tokenizer renders
the chat template the data was trained with, base + adapter gives the merged model's logits
within 1e-4 (the base is the SFT model, not the original checkpoint), `generate` stops at the
end-of-turn id, and a quantized base is stated as dequantized in the export's metadata. A
folder the run may not write stops it in one line naming the folder, nothing in it written.
"""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
tokenizers = pytest.importorskip("tokenizers")

import configs  # noqa: E402
from dpo import loop  # noqa: E402
from test_checkpoint import deny_each, permission_cases, tiny_cfg  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tokenizer(d):
  """A byte-level BPE trained on a few words (seconds), with a chat template; EOS is
  <|endoftext|>, the end of an assistant turn <|im_end|>."""
  tok = tokenizers.ByteLevelBPETokenizer()
  words = ["question", "answer", "good", "bad", "user", "assistant", "system", "yes", "no"]
  tok.train_from_iterator([" ".join(words * 3)] * 4, vocab_size=300, special_tokens=SPECIALS,
                          show_progress=False)
  d.mkdir()
  tok.save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
       "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}))
  return str(d)


def _model(d, vocab):
  config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=128, tie_word_embeddings=False)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config).float()
  model.save_pretrained(d)
  return str(d)


def _data(path):
  rows = [{"conversations": [{"from": "human", "value": f"question {i}"}],
           "chosen": {"from": "gpt", "value": f"good answer {i}"},
           "rejected": {"from": "gpt", "value": f"bad {i}"}} for i in range(16)]
  path.write_text(json.dumps(rows))
  return str(path)


def _logits(model, ids):
  with torch.no_grad():
    return model(input_ids=torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("base_quant", ["none", "bf16", "nf4"])
@pytest.mark.slow
def test_export_loads_in_transformers_and_peft(tmp_path, base_quant):
  tok_dir = _tokenizer(tmp_path / "tok")
  vocab = tokenizers.Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json")).get_vocab_size()
  src = _model(tmp_path / "src", vocab)
  out = tmp_path / "export"
  cfg = configs.DEFAULT.replace(
      init_from=f"hf:{src}", tokenizer=tok_dir, train_data=_data(tmp_path / "d.json"),
      stage="sft,dpo", sft_steps=3, steps=3, sft_learning_rate=1e-2, learning_rate=1e-2,
      lora_rank=2, lora_alpha=4.0, global_batch_size=8, max_prompt_length=24,
      max_target_length=16, eval_every=0, log_every=1, log_kl=False, base_quant=base_quant,
      export_hf=str(out), output_dir=str(tmp_path / "run"))
  loop.run(cfg)

  # The tokenizer: the chat template the data was trained with, the run's special tokens.
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  msgs = [{"role": "user", "content": "question 3"}]
  prompt = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
  assert prompt == "<|im_start|>user\nquestion 3<|im_end|>\n<|im_start|>assistant\n"
  ids = hf_tok.apply_chat_template(msgs + [{"role": "assistant", "content": "good answer 3"}],
                                   tokenize=True)["input_ids"]
  end_of_turn, eos = hf_tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
  gen = transformers.GenerationConfig.from_pretrained(out)
  assert gen.eos_token_id == [eos, end_of_turn] and gen.pad_token_id == eos

  # Merged policy vs base + adapter (PEFT), and the base is the SFT model.
  merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  acfg = json.load(open(out / "adapter" / "adapter_config.json"))
  assert acfg["base_model_name_or_path"] == str(out / "base")
  base = transformers.AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
  with_adapter = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
  diff = np.abs(_logits(merged, ids) - _logits(with_adapter, ids)).max()
  print(f"base_quant={base_quant}: max |logit diff| merged vs base + adapter = {diff:.2e}")
  assert diff < 1e-4, diff
  original = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
  wrong = peft.PeftModel.from_pretrained(original, out / "adapter").eval()
  assert np.abs(_logits(merged, ids) - _logits(wrong, ids)).max() > 1e-2  # SFT moved the base
  # AutoPeftModel finds the base through adapter_config.json alone.
  auto = peft.AutoPeftModelForCausalLM.from_pretrained(out / "adapter", dtype=torch.float32)
  assert np.abs(_logits(auto.eval(), ids) - _logits(merged, ids)).max() < 1e-4

  # generate stops at the end of the turn: bias the first new token to <|im_end|>.
  prompt_ids = torch.tensor([hf_tok(prompt, add_special_tokens=False)["input_ids"]])
  out_ids = merged.generate(prompt_ids, max_new_tokens=12, do_sample=False,
                            sequence_bias={(end_of_turn,): 100.0})
  assert out_ids.shape[1] == prompt_ids.shape[1] + 1 and out_ids[0, -1] == end_of_turn

  info = json.load(open(out / "dpo_jax_export.json"))
  assert info["base_quant"] == base_quant and info["adapter_base"] == str(out / "base")
  from safetensors import safe_open
  with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
    meta = f.metadata()
  assert meta["dpo_jax_base_quant"] == base_quant
  assert ("dequantized" in meta.get("dpo_jax_note", "")) == (base_quant != "none")


@pytest.mark.parametrize("real_chmod", permission_cases())
@pytest.mark.slow
def test_an_export_folder_it_may_not_write_stops_the_run_in_one_line(tmp_path, monkeypatch,
                                                                      real_chmod):
  """--export_hf naming a folder this process may not write (an earlier export behind chmod
  000, or the denial simulated where root writes through it): the run stops in one line naming
  it; nothing in it is written, renamed or removed; writable again, the rerun exports."""
  from dpo import checkpoint
  export = tmp_path / "export"
  export.mkdir()
  (export / "config.json").write_text("{}")  # an earlier export's
  cfg = tiny_cfg(tmp_path / "run", stage="dpo", steps=2, export_hf=str(export))
  with deny_each(real_chmod)(export, monkeypatch):
    with pytest.raises(checkpoint.CheckpointError) as e:
      loop.run(cfg)
  message = str(e.value)
  assert message.startswith(f"{export}: permission denied") and "\n" not in message
  assert "left in place" in message
  assert os.listdir(export) == ["config.json"] and (export / "config.json").read_text() == "{}"
  assert sorted(os.listdir(tmp_path)) == ["export", "run"]
  loop.run(cfg)
  assert {"config.json", "model.safetensors"} <= set(os.listdir(export))
