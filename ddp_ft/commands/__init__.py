"""The bodies of the entry points: ``scripts/*.py``, ``recipes/qwen_ami.py`` and the ``ddp-ft`` subcommands are thin
mains over these, so a pip-installed ddp_ft has them too (``ddp_ft.commands.cli``)."""

from ..distributed import hold_library_notices, keep_upstream_notices_to_rank_zero


def quiet_upstream_notices() -> None:
    """Hold bitsandbytes' CPU notice for ``setup_logging`` and keep alike notices to rank 0; every command's first call.

    It must come before anything imports bitsandbytes, which prints its notice at import, once per process.
    """
    hold_library_notices()
    keep_upstream_notices_to_rank_zero()
