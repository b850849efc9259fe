"""``BucketedTrainer``'s atomic checkpoints: staged by every rank, published whole by rank 0."""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints


class AtomicCheckpoints:
    """The Trainer's ``_save`` and ``_save_checkpoint``, staged and published atomically."""

    _staging_dir: str | None

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """The Trainer's save, keeping ``hub_token`` out of the pickled arguments."""
        token, self.args.hub_token = self.args.hub_token, None
        try:
            super()._save(output_dir, state_dict)
        finally:
            self.args.hub_token = token

    def _get_output_dir(self, trial) -> str:
        return self._staging_dir or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, staged and then renamed into place.

        A save killed half-way leaves only the staging folder, so resuming never picks a partial checkpoint.
        """
        from ..training.checkpoint import (  # import cycle
            STAGING_DIR,
            publish_folder,
        )

        run_dir = super()._get_output_dir(trial)
        staging = Path(run_dir) / STAGING_DIR
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.should_save:
            shutil.rmtree(staging / name, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self._staging_dir = str(staging)
        try:
            self._run_hooks.checkpoint_writing(self.state.global_step)
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_dir = None
        if self.args.should_save:
            self._run_hooks.checkpoint_partly_written(self.state.global_step)
        self.accelerator.wait_for_everyone()  # every rank's files are staged
        if self.args.should_save:
            publish_folder(staging / name, Path(run_dir) / name)
            if not any(staging.iterdir()):
                staging.rmdir()
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()
