"""A Qwen3-shaped model with random weights and a tokenizer in one folder, for the entry points on a machine with no
hub access: ``--model-name-or-path`` then runs the real workload's shapes (speed, memory, the CUDA paths), not its
learning.

    python scripts/random_model.py --tokenizer DATA/qwen2-tokenizer --out /tmp/qwen3-4b-random
    python scripts/train.py --preset qwen3-4b-ami --model-name-or-path /tmp/qwen3-4b-random \\
        --source DATA/ami/ami_abstractive.jsonl --max-steps 4

The weights come from ``ddp_ft.tools.bench.build_random_qwen3``: bf16, as the hub's checkpoint, with the same shapes
as ``scripts/bench_gpu.py --shape``. They are drawn on the GPU where it has room, else on the CPU. The tokenizer comes
from ``ddp_ft.training.data.tokenizer.load_tokenizer`` (chat template, pad token) and is saved beside them.
Refused: a tokenizer with more tokens than the model's vocabulary, and a folder that already holds a model of another
shape (one of this shape is kept, not rebuilt).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from ddp_ft.tools.bench import BENCH_SHAPES, build_random_qwen3
from ddp_ft.training.data.tokenizer import load_tokenizer
from ddp_ft.training.model.memory import Qwen3Shape


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=BENCH_SHAPES, default="qwen3-4b", help="model sizes (scripts/bench_gpu.py's)")
    p.add_argument("--vocab-size", type=int, help="override the shape's vocabulary size")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder or hub id (e.g. DATA/qwen2-tokenizer)")
    p.add_argument("--out", type=Path, required=True, help="the folder to write (a model of this shape in it is kept)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    shape = BENCH_SHAPES[args.shape]
    if args.vocab_size is not None:
        shape = dataclasses.replace(shape, vocab_size=args.vocab_size)
    tokenizer = load_tokenizer(args.tokenizer)
    if len(tokenizer) > shape.vocab_size:
        raise SystemExit(
            f"--tokenizer {args.tokenizer} has {len(tokenizer):,} tokens, more than the {args.shape} shape's vocabulary "
            f"of {shape.vocab_size:,}: token ids past it would index outside the embedding. Pass --vocab-size "
            f"{len(tokenizer)} or a smaller tokenizer."
        )
    if (args.out / "config.json").exists():
        from transformers import AutoConfig

        found = Qwen3Shape.from_config(AutoConfig.from_pretrained(args.out))
        if found != shape:
            raise SystemExit(
                f"--out {args.out} already holds a model of another shape ({found}), not {args.shape}'s ({shape}). "
                "Choose another --out or remove that folder."
            )
    build_random_qwen3(args.out, shape, torch.bfloat16, device="auto")
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: {args.shape} shape, vocabulary {shape.vocab_size:,}, tokenizer {args.tokenizer}")


if __name__ == "__main__":
    main()
