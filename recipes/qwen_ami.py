"""Reference recipe: QLoRA fine-tune with the HF Trainer and BucketedDDP, launched by Accelerate.

    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/qwen_ami.py          # Qwen3-4B on AMI
    accelerate launch --config_file accelerate_configs/2cpu_gloo.yaml recipes/qwen_ami.py     # tiny, 2 CPU processes
    accelerate launch --config_file accelerate_configs/single.yaml recipes/qwen_ami.py        # one process

Without --preset it picks ``qwen3-4b-ami`` when CUDA is available and ``tiny`` otherwise, and says so in
its first log line. Every flag of ``scripts/train.py`` works here too (``--help``).
"""

from __future__ import annotations

import logging
import sys

import torch

from ddp_ft.checkpoint import clean_partial_saves
from ddp_ft.config import parse_settings
from ddp_ft.distributed import (
    DistInfo,
    destroy_distributed,
    failure_recorded,
    init_distributed,
    restart_count,
    setup_logging,
)
from ddp_ft.integrations.recipe import build_trainer, trainer_resume_target

logger = logging.getLogger("ddp_ft.recipe")


def main(argv: list[str] | None = None) -> None:
    with failure_recorded():  # an exception on any rank reaches the launcher's summary: rank, host, traceback
        _run(argv)


def _run(argv: list[str] | None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = None
    if "--preset" not in argv:
        chosen = "qwen3-4b-ami" if torch.cuda.is_available() else "tiny"
        argv = ["--preset", chosen, *argv]
    settings = parse_settings(argv)
    info: DistInfo = init_distributed(timeout_s=settings.ddp.ddp_timeout)
    setup_logging(info)
    why = "CUDA available" if torch.cuda.is_available() else "no CUDA: the embedded tiny default"
    logger.info("preset %s (%s), %d process(es)", settings.preset, why if chosen else "from --preset", info.world_size)
    try:
        if info.is_main_process:  # a save killed half-way left a partial folder: never resumed, removed here
            for name in clean_partial_saves(settings.train.output_dir):
                logger.warning("removed %s: a checkpoint whose save did not finish", name)
        trainer = build_trainer(settings, info)
        trainer.train(resume_from_checkpoint=trainer_resume_target(settings.train.resume, settings.train.output_dir,
                                                                   restart_count()))  # fmt: skip
        if trainer.stopped_by:
            logger.warning("stopped by %s after step %d: checkpoint saved; continue with --resume latest (a torchrun "
                           "restart continues on its own)", trainer.stopped_by, trainer.state.global_step)  # fmt: skip
            return
        metrics = trainer.evaluate()
        trainer.save_model(f"{settings.train.output_dir}/final")  # the unwrapped adapter, on rank 0
        trainer.save_state()
        logger.info("eval: %s", metrics)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
