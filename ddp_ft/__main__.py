"""``python -m ddp_ft`` runs the ``ddp-ft`` command (under ``torchrun -m ddp_ft`` too)."""

import sys

from .commands.cli import main

sys.exit(main())
