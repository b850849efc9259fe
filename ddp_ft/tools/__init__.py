"""The measurement tools, apart from the library: not part of ddp_ft's public API.

* ``bench``: benchmark setup (device, process group, compute dtype), random-weight Qwen3 of any shape, model FLOPs per
  token and the GPUs' peak TFLOPS (``scripts/bench_ddp.py``, ``scripts/bench_gpu.py``, ``scripts/random_model.py``).
* ``ladder``: the DDP ladder, seven ways to average gradients measured side by side, the bucket sweep, the ring
  all-reduce and the collective benchmark (``make ladder``, ``make bucket-sweep``, ``make bench-comm``).
* ``bench_e2e``: ddp_ft's trainers and loop against the stock ones and the limit, end to end (``make bench-e2e``).
* ``gpu_check``: the first thing to run on a CUDA host (``make gpu-check``).
* ``gpu_report``: every GPU measurement in one command (``make gpu-report``).

The rule: the library never imports this package. Only the CLI (``ddp_ft.commands.cli``, ``ddp_ft.commands``),
``scripts/`` and the tools themselves do (``tests/repo/test_layering.py``).
"""
