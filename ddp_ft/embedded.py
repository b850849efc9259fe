"""The embedded tiny model, tokenizer and meetings, for trying ddp_ft offline on a CPU.

They are built once under ``DDP_FT_CACHE`` and load like a hub model.
"""

from __future__ import annotations

import fcntl
from typing import NamedTuple

from .distributed import DistInfo
from .training.data.synthetic import generate_synthetic_meetings
from .training.model.qlora import EMBEDDED_MODEL
from .training.setup import cache_dir, resolve_model_and_tokenizer


class Embedded(NamedTuple):
    """What ``tiny_qwen3_and_meetings`` returns."""

    model_path: str  # the tiny Qwen3's folder, random weights
    tokenizer_path: str  # its tokenizer's folder
    meetings: list[dict[str, str]]  # ``id``, ``dialogue`` and ``summary``


def tiny_qwen3_and_meetings(n_meetings: int = 32, max_words: int = 48, seed: int = 0) -> Embedded:
    """The embedded tiny Qwen3, its tokenizer, and synthetic AMI-like meetings.

    A file lock makes it safe to call in every process of a job.

    Args:
        n_meetings (int): number of meetings. Default: 32
        max_words (int): words kept per transcript. Default: 48
        seed (int): seed of the meetings. Default: 0

    Returns:
        Embedded: ``(model_path, tokenizer_path, meetings)``.

    Raises:
        ValueError: if ``max_words`` is not positive.

    Example:
        >>> model_path, tokenizer_path, meetings = tiny_qwen3_and_meetings(8)
    """
    if max_words <= 0:
        raise ValueError(f"max_words={max_words}: must be a positive integer.")
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / ".embedded.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        model_path, tokenizer_path = resolve_model_and_tokenizer(EMBEDDED_MODEL, DistInfo())
    meetings = [
        {**m, "dialogue": " ".join(m["dialogue"].split()[:max_words])}
        for m in generate_synthetic_meetings(n_meetings, seed)
    ]
    return Embedded(model_path, tokenizer_path, meetings)
