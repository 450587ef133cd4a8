"""Prints the frozen-base memory of the real-size presets: float32, bfloat16, int8, nf4.

Computed from abstract shapes (nothing is allocated): `python -m models.base_memory`.
"""

import dataclasses

import configs
from models import quant, transformer

NAMES = ("llama3.2-1b", "llama3.1-8b", "qwen2.5-0.5b", "qwen2.5-7b", "gemma2-2b")


def main():
  print(f"{'preset':14s} {'params':>8s} {'float32':>10s} {'bf16':>10s} {'int8':>10s} {'nf4':>10s}")
  for name in NAMES:
    m = configs.PRESETS[name].model
    n = transformer.num_params(transformer.abstract(transformer.param_specs(m)))
    row = [transformer.nbytes(quant.abstract_quantized(dataclasses.replace(m, base_quant=q)))
           for q in ("none", "int8", "nf4")]
    gib = lambda b: f"{b / 2**30:8.2f}G"
    print(f"{name:14s} {n / 1e9:7.2f}B {gib(row[0]):>10s} {gib(2 * n):>10s} {gib(row[1]):>10s} "
          f"{gib(row[2]):>10s}")


if __name__ == "__main__":
  main()
