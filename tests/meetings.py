"""Variable-length meeting data for tests: real padding in every micro-batch, uneven answer lengths."""

import json
import random
from pathlib import Path

from ddp_ft.synthetic import generate_synthetic_meetings


def write_mixed_length_meetings(path: Path, n: int = 64, seed: int = 1) -> str:
    """A jsonl of ``n`` synthetic meetings with transcripts cut to 10-160 words and summaries to 5-60 words.

    Through the tiny tokenizer at ``max_seq_len=256``: samples of about 60 to 256 tokens (a few still cut) with
    8 to 70 answer tokens, so micro-batches are padded and answer lengths differ between ranks. (The tiny preset's
    own meetings all fill 256 tokens: no padding at all.)
    """
    rng = random.Random(seed)
    rows = generate_synthetic_meetings(n, seed=seed)
    for row in rows:
        row["dialogue"] = " ".join(row["dialogue"].split()[: rng.randint(10, 160)])
        row["summary"] = " ".join(row["summary"].split()[: rng.randint(5, 60)])
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)
