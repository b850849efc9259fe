"""Checkpoints are atomic: a save that dies half-way loses nothing already saved."""

import json

import pytest
import torch

from ddp_ft import checkpoint as ckpt
from ddp_ft.checkpoint import TrainState, resolve_checkpoint, save_checkpoint
from ddp_ft.distributed import DistInfo


class _Adapter(torch.nn.Module):
    """Stands in for a peft model: save_pretrained writes the weights into a folder."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))

    def save_pretrained(self, path):
        path.mkdir(parents=True)
        torch.save(self.state_dict(), path / "adapter_model.pt")


def _parts():
    model = _Adapter()
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def test_save_writes_a_complete_checkpoint_and_points_latest_at_it(tmp_path):
    model, optimizer, scheduler = _parts()
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3, 0, 6, 24), DistInfo())
    assert path == tmp_path / "checkpoint-3"
    assert resolve_checkpoint("latest", tmp_path) == path
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["sample_in_epoch"] == 6 and state["world_size"] == 1
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_save_that_fails_half_way_leaves_the_previous_checkpoint_and_latest_intact(tmp_path, monkeypatch):
    model, optimizer, scheduler = _parts()
    good = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3, 0, 6, 24), DistInfo())
    before = (good / "optimizer.pt").read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", disk_full)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(6, 0, 12, 48), DistInfo())
    monkeypatch.undo()
    assert not (tmp_path / "checkpoint-6").exists()
    assert resolve_checkpoint("latest", tmp_path) == good
    assert (good / "optimizer.pt").read_bytes() == before


def test_save_total_limit_keeps_the_newest(tmp_path):
    model, optimizer, scheduler = _parts()
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(step), DistInfo(), save_total_limit=2)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]


def test_resume_from_a_folder_that_is_not_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a ddp_ft checkpoint"):
        resolve_checkpoint(str(tmp_path), tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        resolve_checkpoint("latest", tmp_path / "nowhere")
