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

from ddp_ft.config import parse_settings
from ddp_ft.distributed import DistInfo, destroy_distributed, init_distributed, setup_logging
from ddp_ft.integrations.recipe import build_trainer

logger = logging.getLogger("ddp_ft.recipe")


def main(argv: list[str] | None = None) -> None:
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
        trainer = build_trainer(settings, info)
        resume = settings.train.resume
        trainer.train(resume_from_checkpoint=True if resume == "latest" else (resume or None))
        metrics = trainer.evaluate()
        trainer.save_model(f"{settings.train.output_dir}/final")  # the unwrapped adapter, on rank 0
        trainer.save_state()
        logger.info("eval: %s", metrics)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
