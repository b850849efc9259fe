"""What a checkpoint holds: the folder and file names, the format version, the position (:class:`TrainState`) and
every rank's RNG state as tensors and plain Python data.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

ADAPTER_DIR = "adapter"
CHECKPOINT_PREFIX = "ddp_ft-checkpoint"
STATE_FILE = "ddp_ft_state.json"
FORMAT_VERSION = 2  # 2: RNG states as tensors and plain data; 1 held pickled numpy arrays
TRAINER_STATE_FILE = "trainer_state.json"  # the HF Trainer's; ddp_ft <= format 0 used the same name
# Files read by torch.load (weights_only=True), all of them written by save_checkpoint.
TENSOR_FILES = ("optimizer.pt", "scheduler.pt", "rng_states.pt")
SCALER_FILE = "scaler.pt"  # only from float16 runs
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # what peft's save_pretrained writes; its pickled form is .bin
FINAL_DIR = "final"  # a run's last adapter, with its tokenizer and data settings (both entry points)
DATA_FILE = "ddp_ft_data.json"  # the run's DataSettings, beside an adapter: how to format a prompt again


@dataclass
class TrainState:
    """Where training stands; enough to continue exactly.

    Args:
        global_step (int): optimizer steps done.
        epoch (int): current epoch (the sampler's ``set_epoch`` value).
        sample_in_epoch (int): samples of ``epoch``'s global order already trained, over all ranks (a multiple of
            the effective batch; the same number on any world size).
        samples_seen (int): samples consumed over all ranks (the x axis shared by all world sizes).
    """

    global_step: int = 0
    epoch: int = 0
    sample_in_epoch: int = 0
    samples_seen: int = 0


def rng_state() -> dict:
    """This process's RNG states as tensors and plain Python data, so ``torch.load(weights_only=True)`` reads them.

    ``random.getstate()`` is ``(version, 625 ints, gauss_next)``; ``np.random.get_state()`` holds a uint32 array,
    which only a pickle of numpy objects can store, so both keys become int64 tensors (every word fits).

    Returns:
        dict: ``python``, ``numpy``, ``torch`` and, with CUDA, ``cuda`` (this device's generator); ``set_rng_state``
        restores it.
    """
    version, words, gauss_next = random.getstate()
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    if kind != "MT19937":  # np.random's legacy generator is always MT19937; a changed numpy would need a new format
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
    """Restore what ``rng_state`` returned: the next draws of ``random``, ``np.random``, torch (and CUDA) continue
    exactly where they were when it was taken."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss_next"]))
    numpy = state["numpy"]
    key = numpy["key"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", key, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.random.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
