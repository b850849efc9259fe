"""Checkpoint pieces the tests share: a stand-in adapter with its optimizer and schedule, and a folder as
transformers.Trainer saves it."""

import json

import torch
from safetensors.torch import save_file


class Adapter(torch.nn.Module):
    """Stands in for a peft model: save_pretrained writes the weights into a folder, as safetensors."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))

    def save_pretrained(self, path):
        path.mkdir(parents=True)
        save_file(self.state_dict(), path / "adapter_model.safetensors")


def training_parts():
    """A model standing in for a peft one, its AdamW and a constant schedule."""
    model = Adapter()
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def trainer_checkpoint(folder):
    """A checkpoint as transformers.Trainer writes it: adapter files at the top, its own trainer_state.json."""
    folder.mkdir(parents=True)
    state = {
        "global_step": 3,
        "epoch": 0.5,
        "log_history": [{"loss": 7.4, "step": 1}],
        "best_metric": None,
        "max_steps": 16,
        "trial_params": None,
        "is_world_process_zero": True,
    }
    (folder / "trainer_state.json").write_text(json.dumps(state))
    for name in ("adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (folder / name).write_bytes(b"trainer " + name.encode())
    return {p.name: p.read_bytes() for p in folder.iterdir()}
