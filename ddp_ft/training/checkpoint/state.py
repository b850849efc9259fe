"""What a checkpoint holds: file names, format version, position and every rank's RNG state."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

ADAPTER_DIR = "adapter"
CHECKPOINT_PREFIX = "ddp_ft-checkpoint"
STATE_FILE = "ddp_ft_state.json"
FORMAT_VERSION = 2  # 2: RNG states as tensors
TRAINER_STATE_FILE = "trainer_state.json"  # the HF Trainer's
# Files read by torch.load(weights_only=True).
TENSOR_FILES = ("optimizer.pt", "scheduler.pt", "rng_states.pt")
SCALER_FILE = "scaler.pt"  # float16 runs only
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's save_pretrained
FINAL_DIR = "final"  # a run's last adapter, tokenizer and data settings
DATA_FILE = "ddp_ft_data.json"  # the run's DataSettings, to format prompts again


@dataclass
class TrainState:
    """Where training stands; enough to continue exactly.

    Args:
        global_step (int): optimizer steps done.
        epoch (int): current epoch.
        sample_in_epoch (int): samples of the epoch's global order trained, over all ranks.
        samples_seen (int): samples consumed over all ranks.
    """

    global_step: int = 0
    epoch: int = 0
    sample_in_epoch: int = 0
    samples_seen: int = 0


def rng_state() -> dict:
    """This process's RNG states as tensors and plain data, for ``weights_only`` loading.

    The Mersenne Twister keys become int64 tensors, since numpy's uint32 array would need a pickle.

    Returns:
        dict: ``python``, ``numpy``, ``torch`` and, with CUDA, ``cuda``.
    """
    version, words, gauss_next = random.getstate()
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    if kind != "MT19937":  # a changed numpy would need a new format
        raise RuntimeError(f"np.random.get_state() returned a {kind} state; ddp_ft checkpoints store MT19937 only.")
    state = {
        "python": {"version": version, "state": torch.tensor(words, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned, so the next draws continue exactly."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss_next"]))
    numpy = state["numpy"]
    key = numpy["key"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", key, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.random.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
