"""The GPU benchmark (``scripts/bench_gpu.py``, ``make bench-gpu``): Qwen3 QLoRA training speed per mode.

One module per part, each importing only the ones before it:

* ``steps``: the micro-batch and accumulation in use, the random batches, the timed and the profiled optimizer steps;
* ``models``: ``--micro-batch auto``'s choice, and one model, optimizer and loss scaler per mode;
* ``modes``: every mode's state together, one mode's timed steps, every mode's profile;
* ``result``: the JSON it writes and the table it prints;
* ``cli``: the command.
"""
