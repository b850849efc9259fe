"""The measurement tools, apart from the library: not part of ddp_ft's public API.

* ``bench``: benchmark setup (device, process group, compute dtype), random-weight Qwen3 of any shape, model FLOPs per
  token and the GPUs' peak TFLOPS (``bench_ddp``, ``bench_gpu``, ``memory_4bit``, ``scripts/random_model.py``).
* ``ladder``: the DDP ladder, seven ways to average gradients measured side by side, the bucket sweep, the ring
  all-reduce and the collective benchmark (``make ladder``, ``make bucket-sweep``, ``make bench-comm``).
* ``bench_e2e``: ddp_ft's trainers and loop against the stock ones and the limit, end to end (``make bench-e2e``).
* ``gpu_check``: the first thing to run on a CUDA host (``make gpu-check``).
* ``gpu_report``: every GPU measurement in one command (``make gpu-report``).
* ``forecast_check``: ``ddp-ft forecast`` against measured 2-process runs in one command (``make forecast-check``).
* ``bench_gpu``: Qwen3 QLoRA training speed per mode, with and without BucketedDDP (``scripts/bench_gpu.py``).
* ``bench_ddp``: one process, torch DDP and BucketedDDP on the tiny Qwen3 (``scripts/bench_ddp.py``).
* ``memory_4bit``: the 4-bit memory arithmetic against a CPU proxy (``scripts/memory_4bit.py``).
* ``measure_stop``: how long a preempted run takes to stop (``scripts/measure_stop.py``).

The rule: the library never imports this package. Only the CLI (``ddp_ft.commands.cli``, ``ddp_ft.commands``),
``scripts/`` and the tools themselves do (``tests/test_layering.py``).
"""
