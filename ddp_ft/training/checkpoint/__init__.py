"""Atomic checkpoints of the plain loop: adapter, optimizer, scheduler, data position and every rank's RNG state.

A checkpoint is ``output_dir/ddp_ft-checkpoint-N`` holding ``ddp_ft_state.json`` (with a ``format_version``),
never the Hugging Face Trainer's ``checkpoint-N``/``trainer_state.json``: both entry points can share an
output folder, and neither resumes nor prunes the other's checkpoints (the loop refuses a Trainer checkpoint
by name). Rank 0 writes everything into a hidden temporary folder, fsyncs every file and folder, and renames it
into place; ``latest`` is replaced atomically and names a complete checkpoint at every instant, also while a
same-step checkpoint is being replaced. A crash mid-save loses nothing already saved. Every rank contributes
its RNG state (gathered to rank 0), so dropout continues exactly on resume at the same world size; the data
position is a sample count in the epoch's global order, so the data continues exactly on any world size
(``ddp_ft.training.data.DataLayout``).

Loading executes no code from the checkpoint: every ``.pt`` file holds tensors and plain Python data only (the RNG
states too: Python's and numpy's Mersenne Twister keys are stored as int64 tensors, not pickled objects) and is
read with ``torch.load(weights_only=True)``; the adapter is safetensors. ``verify_checkpoint`` reads all of it
before the model is built and refuses a checkpoint holding anything else.

One module per part, each importing only the ones before it:

* ``state``: what a checkpoint holds: file names, ``FORMAT_VERSION``, ``TrainState``, ``rng_state``/``set_rng_state``;
* ``publish``: the atomic file-system side: fsync, rename into place, the ``latest`` pointer, removal,
  ``publish_folder`` (also BucketedTrainer's) and ``clean_partial_saves``;
* ``final``: ``save_final``, the adapter a run ends with in ``output_dir/final``, beside its tokenizer and
  ``ddp_ft_data.json`` (every loop checkpoint's ``adapter/`` holds both too: ``save_adapter_companions``);
* ``save``: ``save_checkpoint`` and pruning;
* ``load``: ``checkpoint_to_resume``, ``resolve_checkpoint``, ``verify_checkpoint``, ``saved_position``,
  ``check_resume_position``,
  ``load_checkpoint``.
"""

from .final import save_adapter_companions, save_final
from .load import (
    check_resume_position,
    checkpoint_to_resume,
    load_checkpoint,
    resolve_checkpoint,
    saved_position,
    verify_checkpoint,
)
from .publish import LATEST, STAGING_DIR, clean_partial_saves, publish_folder
from .save import save_checkpoint
from .state import (
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    CHECKPOINT_PREFIX,
    DATA_FILE,
    FINAL_DIR,
    FORMAT_VERSION,
    SCALER_FILE,
    STATE_FILE,
    TENSOR_FILES,
    TRAINER_STATE_FILE,
    TrainState,
    rng_state,
    set_rng_state,
)

__all__ = [
    "ADAPTER_DIR",
    "ADAPTER_WEIGHTS",
    "CHECKPOINT_PREFIX",
    "DATA_FILE",
    "FINAL_DIR",
    "FORMAT_VERSION",
    "LATEST",
    "SCALER_FILE",
    "STAGING_DIR",
    "STATE_FILE",
    "TENSOR_FILES",
    "TRAINER_STATE_FILE",
    "TrainState",
    "checkpoint_to_resume",
    "clean_partial_saves",
    "load_checkpoint",
    "publish_folder",
    "resolve_checkpoint",
    "rng_state",
    "save_adapter_companions",
    "save_checkpoint",
    "save_final",
    "saved_position",
    "check_resume_position",
    "set_rng_state",
    "verify_checkpoint",
]
