"""Prints the frozen-base memory of the real-size presets for each --base_quant: none (float32),
bf16, int8, nf4 (the layer matrices converted; embeddings and norms stay float32).

    python -m dpo.tools.base_memory [--presets=llama3.2-1b,qwen2.5-7b]

Computed from abstract shapes (nothing is allocated). --presets is the tool's only flag; it reads
each preset's model section and nothing else.
"""


from absl import app, flags

import configs
from models import quant, transformer

FLAGS = flags.FLAGS
NAMES = tuple(configs.REAL_SIZES)


def main(argv) -> None:
  del argv
  print(f"{'preset':14s} {'params':>8s} {'float32':>10s} {'bf16':>10s} {'int8':>10s} {'nf4':>10s}")
  for name in FLAGS.presets:
    specs = transformer.param_specs(configs.get_config(name).model)
    base = transformer.abstract(specs)
    n = transformer.num_params(base)
    row = [transformer.nbytes(quant.abstract_quantized(specs, q, base))
           for q in ("none", "bf16", "int8", "nf4")]
    gib = lambda b: f"{b / 2**30:8.2f}G"
    print(f"{name:14s} {n / 1e9:7.2f}B " + " ".join(f"{gib(b):>10s}" for b in row))


if __name__ == "__main__":
  flags.DEFINE_list("presets", list(NAMES), "configs.py presets whose model section is measured.")
  flags.register_validator("presets", lambda names: set(names) <= set(configs.PRESETS),
                           f"--presets must name presets from {sorted(configs.PRESETS)}")
  app.run(main)
