"""QLoRA in a plain PyTorch loop with BucketedDDP: no Trainer, no Accelerate.

torchrun --standalone --nproc_per_node=2 examples/plain_torch.py
"""

import contextlib

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, set_seed

from ddp_ft.ddp import BucketedDDP
from ddp_ft.distributed import destroy_distributed, init_distributed, keep_upstream_notices_to_rank_zero
from ddp_ft.embedded import tiny_qwen3_and_meetings

ACCUMULATION = 2  # micro-batches per optimizer step


def main() -> None:
    keep_upstream_notices_to_rank_zero()  # peft and torch notices every rank prints alike: rank 0 only
    info = init_distributed()  # from torchrun's environment: gloo on CPU, NCCL on this rank's GPU
    try:
        set_seed(0)  # before the LoRA adapters are drawn: the same adapter on every run
        model_path, tokenizer_path, meetings = tiny_qwen3_and_meetings(n_meetings=16)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        texts = [f"{m['dialogue']}\nSummary: {m['summary']}{tokenizer.eos_token}" for m in meetings]

        def collate(batch: list[str]) -> dict[str, torch.Tensor]:
            enc = tokenizer(batch, padding=True, truncation=True, max_length=128, return_tensors="pt")
            enc["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
            return {k: v.to(info.device) for k, v in enc.items()}

        nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
        base = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=nf4, device_map={"": info.device})
        lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)  # its own: a deprecated API
        base.activation_checkpointing_enable()  # non-reentrant, transformers' default: reentrant starves DDP's hooks
        model = BucketedDDP(get_peft_model(base, lora))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        sampler = DistributedSampler(texts, shuffle=True, seed=0)  # each rank reads its own half
        loader = DataLoader(texts, batch_size=2, sampler=sampler, collate_fn=collate)
        step = 0
        for epoch in range(2):
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            for i, batch in enumerate(loader):
                last = (i + 1) % ACCUMULATION == 0
                with contextlib.nullcontext() if last else model.no_sync():  # all-reduce on the last one only
                    loss = model(**batch).loss
                    (loss / ACCUMULATION).backward()
                if last:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    step += 1
                    if info.is_main_process:
                        print(f"step {step} loss {loss.item():.4f}")
        checksum = sum(p.double().sum().item() for p in model.parameters() if p.requires_grad)
        print(f"rank {info.rank} of world_size={info.world_size}: {step} steps, adapter checksum {checksum:.10g}")
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
