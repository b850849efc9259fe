"""QLoRA fine-tune as a plain PyTorch loop with BucketedDDP.

    python scripts/train.py --preset tiny                               # one process
    torchrun --nproc_per_node=2 scripts/train.py --preset tiny          # two processes (GPUs, or CPUs over gloo)
    torchrun --nproc_per_node=2 scripts/train.py --preset qwen3-4b-ami  # the reference run (needs GPUs + hub access)

Every setting has a flag (--help); a preset sets defaults and flags override them.
"""

from __future__ import annotations

import logging

from ddp_ft.config import parse_settings
from ddp_ft.distributed import destroy_distributed, failure_recorded, init_distributed, setup_logging
from ddp_ft.loop import train

logger = logging.getLogger("ddp_ft.train")


def main(argv: list[str] | None = None) -> None:
    with failure_recorded():  # an exception on any rank reaches torchrun's summary: rank, host, traceback
        settings = parse_settings(argv)
        info = init_distributed(timeout_s=settings.ddp.ddp_timeout)
        setup_logging(info)
        try:
            result = train(settings, info)
            if info.is_main_process:
                logger.info("result: %s", result)
        finally:
            destroy_distributed()


if __name__ == "__main__":
    main()
