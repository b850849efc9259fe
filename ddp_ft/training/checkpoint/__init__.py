"""Atomic checkpoints of the plain loop: adapter, optimizer, scheduler, data position and every rank's RNG state.

A checkpoint is ``output_dir/ddp_ft-checkpoint-N``, named apart from the Trainer's, so neither is mistaken for
the other. Rank 0 writes into a hidden folder, fsyncs, and renames it into place. ``latest`` always names a
complete checkpoint, so a crash mid-save loses nothing saved. The data position is a sample count, so data
resumes exactly on any world size. Loading runs no code: ``.pt`` files hold only tensors and plain data, read
with ``weights_only=True``.

Modules, each importing only those before it: ``state``, ``publish``, ``final``, ``save``, ``load``.
"""

from .final import save_adapter_companions, save_final
from .load import (
    check_resume_position,
    check_resume_settings,
    checkpoint_to_resume,
    load_checkpoint,
    refuse_earlier_run,
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
    "check_resume_settings",
    "checkpoint_to_resume",
    "clean_partial_saves",
    "load_checkpoint",
    "publish_folder",
    "refuse_earlier_run",
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
