"""The plain training path: the loop and the pieces both entry points build a run from.

* ``loop``: ``train`` (one run on this rank: steps, periodic evaluation and checkpoints, the end or a stop);
  ``steps``: one optimizer step's forward/backward over its micro-batches, and evaluation;
* ``setup``: the run before the first step, built once and in order (checks, data, model, optimizer, resume);
* ``config``, ``defaults``, ``ranges``: the settings, their device defaults and their allowed values
  (``configs/``: the presets);
* ``model/``: the QLoRA model and what shapes its speed and memory (precision, kernels, compilation, the memory
  arithmetic and the micro-batch probe, where a model comes from);
* ``data/``: sources, tokenizer and chat template, formatting, packing, the per-rank loader;
* ``checkpoint/``: atomic checkpoints, resume, and the output folder on a shared file system;
* ``preemption``, ``hooks``: stop signals, and the hook point the fault tests install their faults at;
* ``perf_traps/``: correct but slow settings, warned once.

The Trainer path (``ddp_ft.integrations``) builds from the same pieces and never imports the loop: importing this
package loads nothing.
"""
