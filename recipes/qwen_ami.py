"""Reference recipe: QLoRA fine-tune with the HF Trainer and BucketedDDP, launched by Accelerate.

    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/qwen_ami.py          # Qwen3-4B on AMI
    accelerate launch --config_file accelerate_configs/2cpu_gloo.yaml recipes/qwen_ami.py     # tiny, 2 CPU processes
    accelerate launch --config_file accelerate_configs/single.yaml recipes/qwen_ami.py        # one process

Without --preset it picks ``qwen3-4b-ami`` when CUDA is available and ``tiny`` otherwise, and says so in
its first log line. Every flag of ``scripts/train.py`` works here too (``--help``), and one of its own:
``--trainer {hf,trl}`` trains with ``BucketedTrainer`` (default) or TRL's SFTTrainer as ``BucketedSFTTrainer``
(``pip install ddp_ft[trl]``) on the same data, writing the same ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from ddp_ft.config import parse_settings
from ddp_ft.distributed import (
    DistInfo,
    destroy_distributed,
    failure_recorded,
    init_distributed,
    restart_count,
    setup_logging,
)
from ddp_ft.integrations.recipe import TRAINERS, build_trainer, trainer_checkpoint, trainer_resume_target
from ddp_ft.setup import check_run_settings
from ddp_ft.shared_fs import check_shared_resume, prepare_output_dir

logger = logging.getLogger("ddp_ft.recipe")


def main(argv: list[str] | None = None) -> None:
    with failure_recorded():  # an exception on any rank reaches the launcher's summary: rank, host, traceback
        _run(argv)


def _run(argv: list[str] | None) -> None:
    own = argparse.ArgumentParser(add_help=False)  # the recipe's one flag; the rest are scripts/train.py's
    own.add_argument(
        "--trainer",
        choices=TRAINERS,
        default="hf",
        help="hf: BucketedTrainer (transformers' Trainer); trl: BucketedSFTTrainer (TRL's SFTTrainer, the "
        "ddp_ft[trl] extra). Default: hf",
    )
    entry, argv = own.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    chosen = None
    if "--preset" not in argv:
        chosen = "qwen3-4b-ami" if torch.cuda.is_available() else "tiny"
        argv = ["--preset", chosen, *argv]
    settings = parse_settings(argv, parents=[own])  # --help lists --trainer too
    info: DistInfo = init_distributed(timeout_s=settings.ddp.ddp_timeout)
    setup_logging(info)
    why = "CUDA available" if torch.cuda.is_available() else "no CUDA: the embedded tiny default"
    logger.info("preset %s (%s), %d process(es)", settings.preset, why if chosen else "from --preset", info.world_size)
    try:
        output_dir = settings.train.output_dir
        check_run_settings(settings, info)  # before anything is touched
        prepare_output_dir(output_dir, info)  # shared by every node; partial saves (a SIGKILL mid-write) removed
        resume = trainer_resume_target(settings.train.resume, output_dir, restart_count())
        check_shared_resume(lambda: trainer_checkpoint(resume, output_dir), info)
        trainer = build_trainer(settings, info, entry.trainer)
        trainer.train(resume_from_checkpoint=resume)
        if trainer.stopped_by:
            logger.warning(
                "stopped by %s after step %d: checkpoint saved; continue with --resume latest (a torchrun "
                "restart continues on its own)",
                trainer.stopped_by,
                trainer.state.global_step,
            )
            return
        metrics = trainer.evaluate()
        trainer.save_model(f"{settings.train.output_dir}/final")  # the unwrapped adapter, on rank 0
        trainer.save_state()
        logger.info("eval: %s", metrics)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
