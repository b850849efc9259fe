"""The Trainer path of the reference recipe (``recipes/qwen_ami.py``, ``ddp-ft recipe``): the HF Trainer (or TRL's
SFTTrainer) with BucketedDDP, on the same model, data and settings as the plain loop.

A run that names no model starts from ``qwen3-4b-ami`` with CUDA and the embedded ``tiny`` without, as ``ddp-ft train``
does (``ddp_ft.training.model.source``), and says so in its first log line.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from ..distributed import (
    DistInfo,
    destroy_distributed,
    failure_recorded,
    init_distributed,
    restart_count,
    setup_logging,
)
from ..distributed.console import console_or_log
from ..training.checkpoint import check_resume_settings, save_final
from ..training.checkpoint.shared_fs import check_new_run, check_shared_resume, prepare_output_dir
from ..training.config import RunSettings, parse_settings, write_run_config
from ..training.model.source import choose_default, log_choice
from ..training.resolve import resolve_run
from ..training.setup import prepare_run
from . import quiet_upstream_notices

logger = logging.getLogger("ddp_ft.recipe")


def recipe_parser() -> argparse.ArgumentParser:
    """The recipe's own flag (``--trainer``), as a parent parser; the rest are the shared settings."""
    # The integrations import peft, and so bitsandbytes: here, after main() quieted its notice, not at import.
    from ..integrations.recipe import TRAINERS
    from ..integrations.stock import FIND_UNUSED

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument(
        "--trainer",
        choices=TRAINERS,
        default="hf",
        help="hf: BucketedTrainer (transformers' Trainer); trl: BucketedSFTTrainer (TRL's SFTTrainer, the "
        "[trl] extra); stock-hf, stock-trl: transformers' Trainer or TRL's SFTTrainer themselves, on torch DDP "
        "(what ddp_ft is measured against; needs --no-balance-ranks). Default: hf",
    )
    own.add_argument(
        "--stock-find-unused",
        choices=FIND_UNUSED,
        default="trainer",
        help="torch DDP's find_unused_parameters for --trainer stock-hf/stock-trl: trainer (the Trainer's own "
        "choice: True for a PeftModel), true or false. Default: trainer",
    )
    return own


def main(
    argv: list[str] | None = None, parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None
) -> None:
    """Parse, join the process group, train with the Trainer, evaluate, save, tear down.

    Args:
        argv (list[str] | None): ``--trainer`` and the settings' flags. Default: ``sys.argv[1:]``
        parents (Sequence[argparse.ArgumentParser]): a caller's own flags, listed by ``--help`` and ignored here.
        prog (str | None): the command named in usage and errors. Default: the script's name
    """
    quiet_upstream_notices()
    with failure_recorded():  # an exception on any rank reaches the launcher's summary: rank, host, traceback
        own = recipe_parser()
        entry, _ = own.parse_known_args(argv)
        choice = choose_default(argv)
        settings = parse_settings(argv, [own, *parents], choice.preset, prog)  # --help: all
        with console_or_log(Path(settings.train.output_dir) / "logs"):  # as ddp-ft train's
            info = init_distributed(settings.ddp.backend, settings.ddp.ddp_timeout)
            setup_logging(info)
            log_choice(settings, choice, info.world_size)
            try:
                _train(settings, info, entry.trainer, entry.stock_find_unused)
            finally:
                destroy_distributed()


def _train(settings: RunSettings, info: DistInfo, trainer_name: str, stock_find_unused: str = "trainer") -> None:
    """Check, prepare the output folder and the trainer, write run_config.yaml, train, then evaluate and save."""
    from ..integrations.recipe import (
        build_trainer,
        log_resume,
        predict_at_end,
        trainer_checkpoint,
        trainer_resume_target,
    )
    from ..integrations.stock import check_stock_settings

    output_dir = settings.train.output_dir
    resolved = resolve_run(settings, info)  # before anything is touched; once
    check_stock_settings(settings, trainer_name, stock_find_unused)
    prepare_output_dir(output_dir, info)  # shared by every node; partial saves (a SIGKILL mid-write) removed
    resume = trainer_resume_target(settings.train.resume, output_dir, restart_count())
    checkpoint = check_shared_resume(lambda: trainer_checkpoint(resume, output_dir), info)
    if checkpoint is not None:
        check_resume_settings(checkpoint, settings, info)
    parts = prepare_run(settings, info, resolved)
    check_new_run(output_dir, checkpoint, info)  # what an earlier run left is not replaced
    trainer = build_trainer(settings, info, trainer_name, stock_find_unused, resolved, parts=parts)
    write_run_config(
        settings, info, trainer.resolved.as_config()
    )  # every refusal (settings, data, resume) has passed: nothing is written before
    log_resume(checkpoint, info)
    trainer.train(resume_from_checkpoint=resume)
    if getattr(trainer, "stopped_by", None):  # a stock trainer has no stop handling
        step = trainer.state.global_step
        where = f"checkpoint {output_dir}/checkpoint-{step}; continue with the same command and --resume latest"
        # the one line saying where and how to go on is rank 0's
        logger.warning(
            "stopped by %s after step %d: %s",
            trainer.stopped_by,
            step,
            where if info.is_main_process else "rank 0 saved the checkpoint",
        )
        return
    metrics = trainer.evaluate()
    # the unwrapped adapter, its tokenizer and data settings, on rank 0, as the plain loop's final folder
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    save_final(output_dir, model, trainer.processing_class, parts.data_record, info)
    trainer.save_state()
    logger.info("eval: %s", metrics)
    if settings.train.predict:  # after the last collective, as the loop's
        predict_at_end(trainer, parts, settings, info)


if __name__ == "__main__":
    main()
