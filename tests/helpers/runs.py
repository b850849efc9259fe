"""Short in-process runs of both entry points, for the tests of what a run writes and logs."""

from pathlib import Path

from ddp_ft.distributed import DistInfo
from ddp_ft.integrations.recipe import build_trainer
from ddp_ft.training.config import settings_from_preset
from ddp_ft.training.loop import train

STEPS = 2


def short_settings(output_dir: Path, **overrides):
    """The tiny preset cut to two one-sample steps of short sequences, reporting to wandb: about a second on CPU."""
    values = {
        "max_steps": STEPS,
        "effective_batch": 1,
        "micro_batch": 1,
        "num_synthetic": 16,
        "max_seq_len": 128,
        "save_every": 0,
        "report_to": "wandb",
        **overrides,
    }
    return settings_from_preset("tiny", output_dir=str(output_dir), **values)


def short_run(entry: str, output_dir: Path, **overrides) -> int:
    """Train with ``entry`` (``loop`` or ``trainer``) as a single process; returns the optimizer steps done."""
    settings = short_settings(output_dir, **overrides)
    if entry == "loop":
        return train(settings, DistInfo()).steps
    trainer = build_trainer(settings, DistInfo())
    trainer.train()
    return trainer.state.global_step
