"""Your own TRL DPO script, with BucketedDPOTrainer instead of DPOTrainer (the one-line swap; the [trl] extra: pip install ".[trl]" in the clone).

accelerate launch --config_file accelerate_configs/2cpu_gloo.yaml examples/trl_dpo.py
torchrun --standalone --nproc_per_node=2 examples/trl_dpo.py

BucketedKTOTrainer and BucketedRewardTrainer swap in the same way; balance_ranks stays off (the stock sampling).
"""

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, BitsAndBytesConfig
from trl import DPOConfig

from ddp_ft.distributed import keep_upstream_notices_to_rank_zero
from ddp_ft.embedded import tiny_qwen3_and_meetings
from ddp_ft.integrations import BucketedDPOTrainer


def main() -> None:
    keep_upstream_notices_to_rank_zero()  # peft and torch notices every rank prints alike: rank 0 only
    model_path, tokenizer_path, meetings = tiny_qwen3_and_meetings(n_meetings=16)
    # Preference pairs: the meeting's own summary is chosen over the next meeting's.
    rows = [
        {"prompt": f"Summarise the meeting:\n{m['dialogue']}\n", "chosen": m["summary"], "rejected": other["summary"]}
        for m, other in zip(meetings, meetings[1:] + meetings[:1], strict=True)
    ]
    args = DPOConfig(
        output_dir="runs/example-trl-dpo",
        use_cpu=not torch.cuda.is_available(),  # on CPU: one gloo process per rank, not each process alone
        model_init_kwargs={"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")},
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        max_length=128,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
    )
    trainer = BucketedDPOTrainer(  # instead of DPOTrainer(...); every DPOTrainer argument works as before
        model=model_path,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(tokenizer_path),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
    )  # no ref_model: the reference is the base, the adapter disabled
    result = trainer.train()
    trainer.save_model()  # the LoRA adapter, from rank 0
    checksum = sum(p.double().sum().item() for p in trainer.model.parameters() if p.requires_grad)
    print(
        f"rank {args.process_index} of world_size={args.world_size}: {result.global_step} steps, "
        f"adapter checksum {checksum:.10g}"
    )
    trainer.accelerator.end_training()  # every rank tears its process group down


if __name__ == "__main__":
    main()
