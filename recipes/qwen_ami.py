"""Reference recipe: QLoRA fine-tune with the HF Trainer and BucketedDDP, launched by Accelerate.

    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/qwen_ami.py          # Qwen3-4B on AMI
    accelerate launch --config_file accelerate_configs/2cpu_gloo.yaml recipes/qwen_ami.py     # tiny, 2 CPU processes
    accelerate launch --config_file accelerate_configs/single.yaml recipes/qwen_ami.py        # one process

Without --preset (or a preset: key in --config) it picks ``qwen3-4b-ami`` when CUDA is available and ``tiny``
otherwise, and says so in its first log line. Every flag of ``scripts/train.py`` works here too (``--help``, including
``--config FILE.yaml``), and one of its own: ``--trainer {hf,trl}`` trains with ``BucketedTrainer`` (default) or TRL's
SFTTrainer as ``BucketedSFTTrainer`` (the ``[trl]`` extra) on the same data, writing the same
``metrics.jsonl``. The body is ``ddp_ft.commands.recipe`` (also ``ddp-ft recipe``).
"""

from __future__ import annotations

from ddp_ft.commands.recipe import main

if __name__ == "__main__":
    main()
