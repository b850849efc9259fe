"""The embedded tiny model, tokenizer and meetings, for trying ddp_ft (and the ``examples/``) offline on a CPU.

The same path the ``tiny`` preset takes: ``resolve_model_and_tokenizer`` builds the tiny Qwen3 and its tokenizer
once under ``DDP_FT_CACHE`` (default ``~/.cache/ddp_ft``) and returns their folders, which load through
``from_pretrained`` like a hub model; the meetings come from ``generate_synthetic_meetings``.
"""

from __future__ import annotations

import fcntl
from typing import NamedTuple

from .distributed import DistInfo
from .training.data.synthetic import generate_synthetic_meetings
from .training.model.qlora import EMBEDDED_MODEL
from .training.setup import cache_dir, resolve_model_and_tokenizer


class Embedded(NamedTuple):
    """What ``tiny_qwen3_and_meetings`` returns (unpack it: ``model_path, tokenizer_path, meetings = ...``)."""

    model_path: str  # folder of the tiny Qwen3 (3.5M parameters, random weights), for ``from_pretrained``
    tokenizer_path: str  # folder of its byte-level BPE tokenizer (ChatML template), for ``AutoTokenizer``
    meetings: list[dict[str, str]]  # rows with keys ``id``, ``dialogue`` (cut to ``max_words``) and ``summary``


def tiny_qwen3_and_meetings(n_meetings: int = 32, max_words: int = 48, seed: int = 0) -> Embedded:
    """The embedded tiny Qwen3, its tokenizer, and ``n_meetings`` synthetic AMI-like meetings.

    Safe to call in every process of a launched job before (or without) a process group: a file lock in the cache
    lets one process build while the others wait, then each loads the same files.

    Args:
        n_meetings (int): number of meetings. Default: 32
        max_words (int): each transcript keeps its first ``max_words`` words, so samples stay short. Default: 48
        seed (int): seed of the meetings (the model and tokenizer are always the preset's). Default: 0

    Returns:
        Embedded: ``(model_path, tokenizer_path, meetings)``.
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
