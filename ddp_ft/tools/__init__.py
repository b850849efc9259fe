"""The measurement tools, apart from the library and not public API.

* ``bench``: shared benchmark setup, random-weight Qwen3 models, FLOPs and peak TFLOPS.
* ``ladder``: seven ways to average gradients, the bucket sweep and the collective benchmark.
* ``bench_e2e``: ddp_ft's trainers against the stock ones, end to end.
* ``gpu_check``: the first thing to run on a CUDA host.
* ``gpu_report``: every GPU measurement in one command.
* ``forecast_check``: ``ddp-ft forecast`` against measured 2-process runs.
* ``bench_gpu``: QLoRA training speed per mode.
* ``bench_ddp``: one process, torch DDP and BucketedDDP on the tiny Qwen3.
* ``memory_4bit``: the 4-bit memory arithmetic against a CPU proxy.
* ``measure_stop``: how long a preempted run takes to stop.

The library never imports this package (``tests/repo/test_layering.py``).
"""
