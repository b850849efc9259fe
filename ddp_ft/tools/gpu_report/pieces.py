"""Short texts for the packing step of ``make gpu-report``: each AMI meeting's transcript cut into pieces of a few
hundred words, written as the ``text`` format (``{"text": ...}`` per line).

At sequence 2,048 every AMI sample is cut to one full row, so ``packed_2048`` packs nothing: its rows are the
fixed-length reference. Pieces of 280 words pack several to a row, each sequence masked off from its neighbours;
the two runs' non-padding tokens/s give what packing costs.

    python -m ddp_ft.tools.gpu_report.pieces --source ami_abstractive.jsonl --out pieces.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

WORDS = 280


def write_pieces(source: Path, out: Path, words: int = WORDS, column: str = "dialogue") -> int:
    """Write every full ``words``-word piece of each row's ``column`` to ``out``; returns how many."""
    count = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with source.open() as rows, out.open("w") as sink:
        for line in rows:
            text = json.loads(line)[column].split() if line.strip() else []
            for start in range(0, len(text) - words + 1, words):
                sink.write(json.dumps({"text": " ".join(text[start : start + words])}) + "\n")
                count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, required=True, help="the AMI meetings (jsonl with a dialogue column)")
    p.add_argument("--out", type=Path, required=True, help="the pieces (jsonl, text format)")
    p.add_argument("--words", type=int, default=WORDS, help=f"words per piece. Default: {WORDS}")
    args = p.parse_args(argv)
    print(f"{write_pieces(args.source, args.out, args.words)} pieces of {args.words} words in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
