"""The plain PyTorch loop with BucketedDDP, behind ``ddp-ft train``.

python -m ddp_ft.commands.train --preset tiny                                # one process
torchrun --standalone --nproc_per_node=2 -m ddp_ft.commands.train --config my_run.yaml

Without a model it picks ``qwen3-4b-ami`` on CUDA, else the embedded ``tiny``.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from ..distributed import destroy_distributed, failure_recorded, init_distributed, setup_logging
from ..distributed.console import console_or_log
from ..training.config import parse_settings
from ..training.loop import train
from ..training.model.source import choose_default, log_choice
from . import quiet_upstream_notices

logger = logging.getLogger("ddp_ft.train")


def main(
    argv: list[str] | None = None, parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None
) -> None:
    """Parse the settings, join the process group, train, and tear down.

    Args:
        argv (list[str] | None): the settings' flags. Default: ``sys.argv[1:]``
        parents (Sequence[argparse.ArgumentParser]): a caller's flags, shown in ``--help``.
        prog (str | None): the command in usage and errors. Default: the script's name

    Example:
        >>> main(["--preset", "tiny"])
    """
    quiet_upstream_notices()
    with failure_recorded():  # any rank's exception reaches the launcher's summary
        choice = choose_default(argv)
        settings = parse_settings(argv, parents, choice.preset, prog)
        with console_or_log(Path(settings.train.output_dir) / "logs"):  # survive a lost console
            info = init_distributed(settings.ddp.backend, settings.ddp.ddp_timeout)
            setup_logging(info)
            log_choice(settings, choice, info.world_size)
            try:
                result = train(settings, info)
                if info.is_main_process:
                    logger.info("result: %s", result)
            finally:
                destroy_distributed()


if __name__ == "__main__":
    main()
