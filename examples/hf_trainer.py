"""Your own HF Trainer script, with BucketedTrainer instead of Trainer (the one-line swap): QLoRA, 4-bit + LoRA.

accelerate launch --config_file accelerate_configs/2cpu_gloo.yaml examples/hf_trainer.py
torchrun --standalone --nproc_per_node=2 examples/hf_trainer.py
"""

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    DataCollatorForLanguageModeling,
    TrainingArguments,
    set_seed,
)

from ddp_ft.distributed import keep_upstream_notices_to_rank_zero
from ddp_ft.embedded import tiny_qwen3_and_meetings
from ddp_ft.integrations import BucketedTrainer


def main() -> None:
    keep_upstream_notices_to_rank_zero()  # peft and torch notices every rank prints alike: rank 0 only
    args = TrainingArguments(
        output_dir="runs/example-hf-trainer",
        use_cpu=not torch.cuda.is_available(),  # on CPU: one gloo process per rank, not each process alone
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-3,
        activation_checkpointing=True,  # non-reentrant, transformers' default: reentrant starves DDP's gradient hooks
        logging_steps=1,
        save_strategy="no",
        report_to=[],
    )
    set_seed(args.seed)  # before the LoRA adapters are drawn: the same adapter on every run
    model_path, tokenizer_path, meetings = tiny_qwen3_and_meetings(n_meetings=16)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    texts = [f"{m['dialogue']}\nSummary: {m['summary']}{tokenizer.eos_token}" for m in meetings]
    train_set = Dataset.from_dict({"text": texts}).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=128), remove_columns=["text"]
    )
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    base = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=nf4, device_map={"": args.device})
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(prepare_model_for_kbit_training(base, use_gradient_checkpointing=False), lora)
    trainer = BucketedTrainer(  # instead of Trainer(...): the model trains in BucketedDDP
        model=model,
        args=args,
        train_dataset=train_set,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    result = trainer.train()
    trainer.save_model()  # the LoRA adapter, from rank 0
    checksum = sum(p.double().sum().item() for p in model.parameters() if p.requires_grad)
    ran = f"rank {args.process_index} of world_size={args.world_size}: {result.global_step} steps"
    print(f"{ran}, adapter checksum {checksum:.10g}")
    trainer.accelerator.end_training()  # every rank tears its process group down


if __name__ == "__main__":
    main()
