"""The real test data (the AMI meetings, Qwen2's tokenizer), found through ``DDP_FT_TEST_DATA``.

``make test`` sets it to the data folder beside the repository when there is one; without it, the tests that need the
data are skipped with the reason."""

import os
from pathlib import Path

TEST_DATA = Path(os.environ.get("DDP_FT_TEST_DATA") or "/nonexistent")
AMI = TEST_DATA / "ami" / "ami_abstractive.jsonl"
QWEN2_TOKENIZER = TEST_DATA / "qwen2-tokenizer"
