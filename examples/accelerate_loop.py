"""Your own Accelerate loop, with BucketedAccelerator instead of Accelerator (the one-line swap).

accelerate launch --config_file accelerate_configs/2cpu_gloo.yaml examples/accelerate_loop.py
"""

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, set_seed

from ddp_ft.distributed import keep_upstream_notices_to_rank_zero
from ddp_ft.embedded import tiny_qwen3_and_meetings
from ddp_ft.integrations import BucketedAccelerator


def main() -> None:
    keep_upstream_notices_to_rank_zero()  # peft and torch notices every rank prints alike: rank 0 only
    # instead of Accelerator(...); cpu=True on a machine without CUDA, or each process would train alone
    accelerator = BucketedAccelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2)
    set_seed(0)  # before the LoRA adapters are drawn and the data shuffled: the same adapter on every run
    model_path, tokenizer_path, meetings = tiny_qwen3_and_meetings(n_meetings=16)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    texts = [f"{m['dialogue']}\nSummary: {m['summary']}{tokenizer.eos_token}" for m in meetings]

    def collate(batch: list[str]) -> dict[str, torch.Tensor]:
        enc = tokenizer(batch, padding=True, truncation=True, max_length=128, return_tensors="pt")
        enc["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        return enc

    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    base = AutoModelForCausalLM.from_pretrained(
        model_path, quantization_config=nf4, device_map={"": accelerator.device}
    )
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)  # its own: a deprecated API
    base.activation_checkpointing_enable()  # non-reentrant, transformers' default: reentrant starves DDP's hooks
    model = get_peft_model(base, lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loader = DataLoader(texts, batch_size=2, shuffle=True, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # the model comes back in BucketedDDP
    step = 0
    for _epoch in range(2):  # the prepared loader reshuffles each epoch, the same way on every rank
        for batch in loader:
            with accelerator.accumulate(model):  # no_sync on all but the step's last micro-batch
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()  # skipped by Accelerate until the step's last micro-batch
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                accelerator.print(f"step {step} loss {loss.item():.4f}")  # rank 0 only
    trainable = [p for p in accelerator.unwrap_model(model).parameters() if p.requires_grad]
    checksum = sum(p.double().sum().item() for p in trainable)
    rank, world_size = accelerator.process_index, accelerator.num_processes
    print(f"rank {rank} of world_size={world_size}: {step} steps, adapter checksum {checksum:.10g}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
