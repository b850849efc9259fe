"""The plain PyTorch loop with BucketedDDP (``ddp_ft.training.loop.train``): ``scripts/train.py`` and ``ddp-ft train``.

python -m ddp_ft.commands.train --preset tiny                                # one process
torchrun --standalone --nproc_per_node=2 -m ddp_ft.commands.train --config my_run.yaml

A run that names no model starts from ``qwen3-4b-ami`` with CUDA and the embedded ``tiny`` without, as the recipe does
(``ddp_ft.training.model.source``), and says so in its first log line.
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
    """Parse the settings, join the process group, train (the loop writes ``run_config.yaml``), tear down.

    Once the console is gone (a pipe's reader ended, a closed terminal), the output goes to
    ``<output_dir>/logs/console.log`` (``ddp_ft.distributed.console``).

    Args:
        argv (list[str] | None): the settings' flags (``ddp_ft.training.config.build_parser``).
            Default: ``sys.argv[1:]``
        parents (Sequence[argparse.ArgumentParser]): a caller's own flags, listed by ``--help`` and ignored here.
        prog (str | None): the command named in usage and errors. Default: the script's name
    """
    quiet_upstream_notices()
    with failure_recorded():  # an exception on any rank reaches torchrun's summary: rank, host, traceback
        choice = choose_default(argv)
        settings = parse_settings(argv, parents, choice.preset, prog)
        with console_or_log(Path(settings.train.output_dir) / "logs"):  # `| tee` ended by Ctrl-C: a stop goes on
            info = init_distributed(timeout_s=settings.ddp.ddp_timeout)
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
