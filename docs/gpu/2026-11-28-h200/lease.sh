#!/bin/bash
# One GPU lease: carried wheels, the cuda tests (TESTS=1), then make gpu-report's STEPS until DEADLINE s; results
# packed into $OUT/report.tgz (weights and checkpoints left out).
set -u
T0=$(date +%s); DEADLINE=${DEADLINE:-560}; TESTS=${TESTS:-1}; STEPS=${STEPS:-recipe_defaults}
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
R=/tmp/rep; mkdir -p $R
cp .gpudata/COMMIT $R/ 2>/dev/null
{ nvidia-smi; python3 -c "import torch,transformers,peft,bitsandbytes,trl,datasets,triton;print(torch.__version__,transformers.__version__,peft.__version__,bitsandbytes.__version__,trl.__version__,datasets.__version__,triton.__version__)"; } > $R/host.txt 2>&1
if [ "$TESTS" = 1 ]; then
  timeout 170 python3 -m pytest -q -p no:cacheprovider -m cuda \
    tests/training/test_packing.py tests/training/test_attention.py tests/training/test_kernels.py > $R/cuda_tests.log 2>&1
  echo "cuda tests rc=$? in $(( $(date +%s) - T0 )) s"; tail -5 $R/cuda_tests.log
fi
B=$(( $(left) - 25 )); echo "report budget $B s"
timeout $(( B + 15 )) python3 scripts/gpu_report.py --data .gpudata/data --budget-s $B --out $R/gpu_report.json --steps $STEPS > $R/gpu_report_console.log 2>&1
echo "report rc=$?"; tail -40 $R/gpu_report_console.log
cd /tmp && tar czf $OUT/report.tgz --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' --exclude='*.pth' \
  --exclude='qwen3-4b-random' --exclude='*checkpoint-*' --exclude='final' rep
ls -la $OUT
