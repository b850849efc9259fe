# The two commands of the README: `make test` and `make demo`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install test lint demo bench bench-comm bench-e2e forecast-check ladder bucket-sweep gpu-check bench-gpu gpu-report train-reference

# setuptools prints a 12-line "Editable installation" notice (a BuildBackendWarning) on every editable build: ignored
# by its message only, so any other warning or error of the build still shows.
QUIET_EDITABLE = PYTHONWARNINGS="ignore:Editable installation:UserWarning"

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(QUIET_EDITABLE) $(PY) -m pip install --quiet -c constraints.txt -e ".[dev,trl]"
	touch $@

install: $(VENV)/.installed

# The real test data (AMI, Qwen2's tokenizer) beside the checkout, when there: the tests that need it skip without it.
TEST_DATA ?= $(wildcard $(CURDIR)/../shared/data)

# Two workers (pytest-xdist): a test's processes leave a core idle while they start, import and wait, which the other
# worker's test fills; `pytest -n 0` runs one test at a time.
test: install
	$(PY) -m ruff check ddp_ft scripts tests
	DDP_FT_TEST_DATA=$(TEST_DATA) $(PY) -m pytest -n 2

lint: install
	$(PY) -m ruff check ddp_ft scripts tests
	$(PY) -m ruff format --check ddp_ft scripts tests

# The main job on the embedded default (tiny Qwen3, synthetic AMI-like data) with the HF Trainer + BucketedDDP:
# one process, then two (gloo), then two independent single processes side by side (no communication: the limit
# two devices allow), then the comparison (table, PNG, wandb). One thread per process: the CPU analogue of one GPU
# per process, so the single run is a fair baseline. Quiet on purpose: one progress bar per run (rank 0's; the second
# independent run writes to runs/demo/alone1.log), wandb silent (the comparison says once where its runs are and how
# to sync them), no dataset or weight-loading progress bars, the runs' info logs off (DDP_FT_LOG_LEVEL=WARNING; the
# comparison still says where its files and wandb run are); warnings still show.
DEMO_ENV = WANDB_DIR=runs/demo WANDB_SILENT=true HF_DATASETS_DISABLE_PROGRESS_BARS=1 HF_HUB_DISABLE_PROGRESS_BARS=1
DEMO_RUN = $(DEMO_ENV) DDP_FT_LOG_LEVEL=WARNING OMP_NUM_THREADS=1 $(VENV)/bin/accelerate launch
demo: install
	@rm -rf runs/demo && mkdir -p runs/demo
	@echo "== 1/4: one process"
	@$(DEMO_RUN) --config_file accelerate_configs/single.yaml recipes/qwen_ami.py --output-dir runs/demo/single --wandb-group demo
	@echo "== 2/4: two processes, BucketedDDP over gloo"
	@$(DEMO_RUN) --config_file accelerate_configs/2cpu_gloo.yaml recipes/qwen_ami.py --output-dir runs/demo/ddp --wandb-group demo
	@echo "== 3/4: two independent single processes side by side (the second's output: runs/demo/alone1.log)"
	@$(DEMO_RUN) --config_file accelerate_configs/single.yaml recipes/qwen_ami.py --output-dir runs/demo/alone0 --report-to none & \
	$(DEMO_RUN) --config_file accelerate_configs/single.yaml recipes/qwen_ami.py --output-dir runs/demo/alone1 --report-to none \
		> runs/demo/alone1.log 2>&1; \
	status=$$?; [ $$status -eq 0 ] || tail -n 30 runs/demo/alone1.log; wait $$! && exit $$status
	@echo "== 4/4: the comparison"
	@$(DEMO_ENV) $(PY) scripts/compare.py runs/demo/single runs/demo/ddp --independent runs/demo/alone0 runs/demo/alone1 \
		--out runs/demo/comparison --wandb-project ddp_ft --wandb-group demo

bench: install
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 scripts/bench_ddp.py --out bench_results/bench_ddp.json

# The DDP ladder: seven ways to average gradients, from a per-parameter all-reduce after backward to BucketedDDP, each
# step split into compute / non-compute / idle / overlap, on tiny Qwen3 QLoRA and full fine-tuning (table, JSON, PNG).
ladder: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=2 scripts/ladder.py --out bench_results/ladder.json

# Bucket sizing: BucketedDDP's bucket_cap_mb and first_bucket_cap_mb swept on both workloads, buckets against exposed
# communication and step time (table, JSON, PNG).
bucket-sweep: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=2 scripts/bucket_sweep.py --out bench_results/bucket_sweep.json

# All-reduce from 4 KiB to 256 MiB through the backend and through the ring (ddp_ft.tools.ladder.ring), 2 ranks: time,
# algbw and busbw per size, and the smallest size near the peak busbw, a floor for bucket_cap_mb (table, JSON, PNG).
bench-comm: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=2 scripts/bench_comm.py --out bench_results/bench_comm.json

# End to end: the recipe with BucketedTrainer / BucketedSFTTrainer against the same recipe on the stock Trainer (torch DDP,
# find_unused_parameters as the Trainer sets it, and False) and the stock SFTTrainer, plus two independent single
# processes (the limit), alternated 5 times on the tiny preset's data and on meetings of mixed lengths: paired ratios,
# the chain between stock and ddp_ft, the loss check (table, JSON, PNG; ~30 minutes on 2 cores). The loop against its
# limit: scripts/bench_e2e.py --configs pair-loop ddp-loop pair-recipe ddp-recipe.
bench-e2e: install
	$(PY) scripts/bench_e2e.py --repeats 5 --out bench_results/bench_e2e.json

# ddp-ft forecast validated on this host's CPU (a few minutes on 2 cores): the link probe, one process, two single
# processes at once, three 2-process runs (gloo, tiny preset, 16 steps); the forecast against the runs' range.
forecast-check: install
	$(PY) -m ddp_ft.tools.forecast_check --out bench_results/forecast_check

# The first thing to run on a CUDA host (under 5 minutes, exit status 1 on any failure): BucketedDDP against torch DDP,
# no communication under no_sync, the compute dtype for these GPUs, a short 4-bit QLoRA run; 1 process, then 2 on 2+ GPUs.
gpu-check: install
	$(PY) scripts/gpu_check.py --out bench_results/gpu_check.json

# Qwen3-4B-shaped QLoRA (random weights, no download) on this host's GPUs: tokens/s, step time, peak memory, MFU;
# 1 process (BucketedDDP vs no wrapper), then 2 when there are 2+ GPUs (the scaling).
bench-gpu: install
	$(PY) scripts/bench_gpu.py --out bench_results/bench_gpu_1.json
	if [ "$$($(PY) -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then \
		$(VENV)/bin/torchrun --standalone --nproc_per_node=2 scripts/bench_gpu.py --out bench_results/bench_gpu_2.json; fi

# Every GPU measurement in one command, most valuable first, under 10 minutes (--budget-s): bench_gpu at the reference
# shape and at --micro-batch auto, --liger and --compile against the same run without them, 2 processes sharing the GPU
# over gloo, gpu_check, the ladder and the scaling on 2+ GPUs. The JSON is rewritten after each step (a .md beside it).
gpu-report: install
	$(PY) scripts/gpu_report.py --out bench_results/gpu_report.json --data ../shared/data

# The reference run on a machine with 2 GPUs and hub access (Qwen/Qwen3-4B, knkarthick/AMI).
train-reference: install
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 scripts/train.py --preset qwen3-4b-ami
