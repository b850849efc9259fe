"""The bodies of the entry points: ``scripts/*.py``, ``recipes/qwen_ami.py`` and the ``ddp-ft`` subcommands are thin
mains over these, so a pip-installed ddp_ft has them too (``ddp_ft.commands.cli``)."""

from ..distributed import hold_library_notices

hold_library_notices()  # before peft imports bitsandbytes, whose CPU notice would print once per process
