"""Your own TRL GRPO script, with BucketedGRPOTrainer instead of GRPOTrainer (the one-line swap; the [trl] extra).

accelerate launch --config_file accelerate_configs/2cpu_gloo.yaml examples/trl_grpo.py
torchrun --standalone --nproc_per_node=2 examples/trl_grpo.py

Completions come from transformers' generate on the unwrapped model; BucketedDDP all-reduces only the step's gradients.
"""

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer
from trl import GRPOConfig

from ddp_ft.distributed import keep_upstream_notices_to_rank_zero
from ddp_ft.embedded import tiny_qwen3_and_meetings
from ddp_ft.integrations import BucketedGRPOTrainer


def brevity(completions: list[str], **kwargs) -> list[float]:
    """The reward: shorter completions score higher (any Python function of the completions will do)."""
    return [-len(completion) / 100 for completion in completions]


def main() -> None:
    keep_upstream_notices_to_rank_zero()  # peft and torch notices every rank prints alike: rank 0 only
    model_path, tokenizer_path, meetings = tiny_qwen3_and_meetings(n_meetings=16, max_words=16)
    rows = [{"prompt": f"Summarise the meeting:\n{m['dialogue']}\n"} for m in meetings]
    args = GRPOConfig(
        output_dir="runs/example-trl-grpo",
        use_cpu=not torch.cuda.is_available(),  # on CPU: one gloo process per rank, not each process alone
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_generations=2,  # each prompt's group of completions, spread over the ranks by TRL's sampler
        max_completion_length=8,
        max_steps=4,
        learning_rate=1e-3,
        activation_checkpointing=False,  # off, by its new name: TRL turns it on by the old one, which warns per rank
        logging_steps=1,
        save_strategy="no",
        report_to=[],
    )
    trainer = BucketedGRPOTrainer(  # instead of GRPOTrainer(...); every GRPOTrainer argument works as before
        model=model_path,
        reward_funcs=brevity,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(tokenizer_path),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
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
