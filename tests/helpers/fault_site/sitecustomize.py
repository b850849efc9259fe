"""Installs the fault tests' faults in a process the suite starts, when ``DDP_FT_INJECT_FAULT`` asks for some.

Python imports this module at start-up from the ``PYTHONPATH`` the suite gives its subprocesses
(``tests.helpers.dist_harness.PYTHONPATH``), so the real launchers and entry points run unchanged.
"""

import os

if os.environ.get("DDP_FT_INJECT_FAULT"):
    from tests.helpers.faults import install_from_env

    install_from_env()
