"""The plain training path: the loop and the pieces both entry points build a run from.

* ``loop``, ``steps``: the training loop and one optimizer step;
* ``setup``: everything before the first step, built once, in order;
* ``config``, ``ranges``: the settings and their allowed values;
* ``model/``, ``data/``, ``checkpoint/``: the QLoRA model, the data pipeline, checkpoints and resume;
* ``preemption``, ``hooks``: stop signals and fault-test hook points;
* ``perf_traps/``: correct but slow settings, warned once.

The Trainer path (``ddp_ft.integrations``) reuses the pieces, not the loop. Importing this package loads nothing.
"""
