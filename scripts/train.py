"""QLoRA fine-tune as a plain PyTorch loop with BucketedDDP (the body: ``ddp_ft.commands.train``; ``ddp-ft train``).

    python scripts/train.py --preset tiny                               # one process
    torchrun --nproc_per_node=2 scripts/train.py --preset tiny          # two processes (GPUs, or CPUs over gloo)
    torchrun --nproc_per_node=2 scripts/train.py --preset qwen3-4b-ami  # the reference run (needs GPUs + hub access)
    torchrun --nproc_per_node=2 scripts/train.py --config configs/tiny.yaml --max-steps 4
    CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node=2 scripts/train.py --preset tiny --backend gloo   # sharing a GPU

Every setting has a flag (--help); precedence, lowest first: defaults, --preset, --config, flags. The resolved
settings are written to <output_dir>/run_config.yaml (--config on it reruns them).
"""

from __future__ import annotations

from ddp_ft.commands.train import main

if __name__ == "__main__":
    main()
