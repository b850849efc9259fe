"""What importing a part of ddp_ft pulls in, each checked in a fresh interpreter.

``ddp_ft.ddp`` wraps any ``nn.Module``: importing it must need torch alone, not ddp_ft's model, data or settings
modules nor any Hugging Face library. The plugin (``ddp_ft.integrations``) subclasses ``Trainer`` and
``Accelerator``, so it imports transformers and accelerate (and with ``transformers.Trainer``, whatever that imports:
peft, datasets, bitsandbytes when installed), but not ddp_ft's model loading, data pipeline or synthetic generator,
nor trl (an optional extra, imported when ``BucketedSFTTrainer`` is first used). Neither loads the measurement tools
(``ddp_ft.tools``).
"""

import os
import subprocess
import sys
from pathlib import Path

from ..helpers.dist_harness import PYTHONPATH

ROOT = Path(__file__).resolve().parents[2]
HF_LIBRARIES = {"transformers", "peft", "datasets", "accelerate", "bitsandbytes", "wandb"}
RUN_MODULES = {
    "ddp_ft.training.data",
    "ddp_ft.training.model.qlora",
    "ddp_ft.training.data.synthetic",
    "ddp_ft.training.config",
    "ddp_ft.training.checkpoint",
    "ddp_ft.training.loop",
    "ddp_ft.training.steps",
}
TOOLS = "ddp_ft.tools"


def _tools(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m == TOOLS or m.startswith(TOOLS + "."))


def _imported_by(statement: str) -> set[str]:
    probe = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return set(run.stdout.split())


def test_import_ddp_needs_only_torch():
    modules = _imported_by("import ddp_ft.ddp")
    assert "ddp_ft.ddp.settings" in modules  # DDPSettings lives beside the wrapper
    assert not {m for m in modules if m.split(".")[0] in HF_LIBRARIES}, "ddp_ft.ddp imported a Hugging Face library"
    assert not modules & RUN_MODULES, f"ddp_ft.ddp imported {sorted(modules & RUN_MODULES)}"
    assert not _tools(modules), f"ddp_ft.ddp imported {_tools(modules)}"


def test_import_integrations_skips_run_modules():
    modules = _imported_by("import ddp_ft.integrations")
    assert {"ddp_ft.integrations.trainer", "ddp_ft.integrations.accelerate", "transformers", "accelerate"} <= modules
    assert not modules & RUN_MODULES, f"ddp_ft.integrations imported {sorted(modules & RUN_MODULES)}"
    assert not _tools(modules), f"ddp_ft.integrations imported {_tools(modules)}"
    assert "wandb" not in modules
    assert not {"trl", "ddp_ft.integrations.trl"} & modules, (
        "trl is an optional extra: only BucketedSFTTrainer needs it"
    )


_GLOBAL_STATE = """
import logging, warnings
import accelerate, datasets, peft, torch, transformers  # what they change on import is theirs

def state():
    notices, root = logging.getLogger("bitsandbytes.backends.cpu.ops"), logging.getLogger()
    return [list(warnings.filters), list(notices.filters), list(root.handlers), [root.level]]

before = state()
import ddp_ft, ddp_ft.integrations, ddp_ft.training, ddp_ft.commands
added = [[x for x in a if x not in b] for a, b in zip(state(), before)]
assert not any(added), f"warning filters, bitsandbytes' logger filters, root handlers, root level: {added}"
"""


def test_import_leaves_warnings_and_logging_untouched():
    """On a launched rank above 0 too, where the entry points' explicit call would hold notices back."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "RANK": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _GLOBAL_STATE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stderr[-3000:]
