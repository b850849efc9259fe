"""The pieces of the in-process Trainer and Accelerate tests: a process made an ``accelerate launch`` rank, the tiny
regression models and rows the Trainer takes, its 2-process arguments, and a record of the collectives called."""

import os

import torch
from torch import nn

from .models import Net


def as_accelerate_rank(rank: int, world_size: int) -> None:
    """What `accelerate launch` sets, so Accelerate sees MULTI_CPU and joins the harness's group."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )


class Regressor(nn.Module):
    """The test Net as the Trainer wants it: keyword inputs, a dict with the loss."""

    def __init__(self, out_of_memory_once: bool = False):
        super().__init__()
        self.net = Net()
        self.out_of_memory_once = out_of_memory_once

    def forward(self, x, y):
        if self.out_of_memory_once:
            self.out_of_memory_once = False
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 TB.")
        return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}


def regression_rows(n=64):
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(16, generator=g), "y": torch.randn(4, generator=g)} for _ in range(n)]


def gloo_trainer_args(out: str, **arguments):
    """TrainingArguments of the 2-process Trainer tests: CPU, gloo, a log every step, no saves, whole batches;
    ``arguments`` add to or override these."""
    from transformers import TrainingArguments

    defaults = {
        "use_cpu": True,
        "report_to": [],
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_drop_last": True,
        "remove_unused_columns": False,
        "ddp_backend": "gloo",
    }
    return TrainingArguments(output_dir=out, **{**defaults, **arguments})


class TokenRegressor(nn.Module):
    """Token-shaped inputs (the Trainer counts tokens from ``input_ids`` / ``attention_mask``) around the test Net."""

    def __init__(self):
        super().__init__()
        self.net = Net()

    def forward(self, input_ids, attention_mask, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}


def padded_rows(n=32, length=12):
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        mask = torch.zeros(length, dtype=torch.long)
        mask[: 1 + i % length] = 1  # 1 to 12 real tokens, the rest padding
        rows.append(
            {
                "input_ids": torch.randint(0, 100, (length,), generator=g),
                "attention_mask": mask,
                "x": torch.randn(16, generator=g),
                "y": torch.randn(4, generator=g),
            }
        )
    return rows


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "all_gather_object", "barrier")


def record_collectives(log: list[str]) -> None:
    """Append the name of every ``torch.distributed`` collective this process calls to ``log``."""
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name)

        def recorded(*args, _name=name, _original=original, **kwargs):
            log.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, recorded)


class CausalTokens(nn.Module):
    """What the Trainer treats as a causal LM: labels, loss kwargs (so it counts the step's answer tokens and passes
    ``num_items_in_batch``) and a loss type that shifts the labels. Records, per micro-step, its batch's own answer
    tokens, the count it was given and the loss it returned."""

    loss_type = "ForCausalLM"

    def __init__(self):
        super().__init__()
        self.net = Net()
        self.seen: list[tuple[int, float, float]] = []

    def forward(self, input_ids, attention_mask, labels, x, y, num_items_in_batch=None, **kwargs):
        answers = labels[..., 1:].ne(-100).sum()
        loss = ((self.net(x) - y) ** 2).sum() * answers / num_items_in_batch
        self.seen.append((int(answers), float(num_items_in_batch), float(loss)))
        return {"loss": loss}


def labelled_rows():
    """The padded rows with causal-LM labels: the first 2 tokens a prompt (-100), padding -100."""
    rows = padded_rows()
    for row in rows:
        labels = row["input_ids"].clone()
        labels[:2] = -100
        labels[row["attention_mask"] == 0] = -100
        row["labels"] = labels
    return rows


def token_rows(n: int = 16):
    """Token rows of mixed lengths (8 to 20), labels = inputs: padding varies per batch, as with real data."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = torch.randint(3, 60, (8 + (i * 5) % 13,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def collate_tokens(rows):
    width = max(len(r["input_ids"]) for r in rows)
    pad = lambda seq, value: seq + [value] * (width - len(seq))  # noqa: E731
    return {
        "input_ids": torch.tensor([pad(r["input_ids"], 0) for r in rows]),
        "labels": torch.tensor([pad(r["labels"], -100) for r in rows]),
        "attention_mask": torch.tensor([pad([1] * len(r["input_ids"]), 0) for r in rows]),
    }


def user_qlora_model(model_dir: str):
    """What a QLoRA user's script builds: NF4 base, peft's k-bit preparation, LoRA. Without checkpointing: a whole
    compiled model would then capture the layers too (torch.utils.checkpoint is never compiled, so a checkpointed
    layer breaks the graph and runs eager), which is the case where whole-model compilation loses the overlap."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    base = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quantization, device_map={"": "cpu"})
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    base.enable_input_require_grads()
    torch.manual_seed(0)
    return get_peft_model(base, LoraConfig(r=8, lora_dropout=0.0, target_modules="all-linear"))
