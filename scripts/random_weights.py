"""A model directory with a real model's shape and tokenizer but random weights, for timing a model
whose weights cannot be had where the timing runs (the lent GPU machine reaches no network, and
Qwen2.5-Coder-1.5B's 1.1 GB file cannot travel to it). A plain decoding step's cost depends on the
shapes alone, so tokens/s against transformers and the memory bound are the real model's; what the
tokens are (and so any drafter's acceptance) is not.

    python scripts/random_weights.py SRC OUT --dtype bfloat16 --device cuda

SRC is a model directory (config.json and the tokenizer's files); only those are read.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

KEEP = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def write(src: Path, out: Path, dtype: torch.dtype, device: str, seed: int = 0) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (src / "config.json").is_file():
        raise SystemExit(f"{src} has no config.json")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(src)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    for name in KEEP[1:]:  # save_pretrained wrote config.json (with the dtype)
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    out = write(args.src, args.out, getattr(torch, args.dtype), args.device)
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
