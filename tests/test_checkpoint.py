"""Checkpoints are atomic: a save that dies half-way loses nothing already saved."""

import json
import os
from pathlib import Path

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
    assert path == tmp_path / "ddp_ft-checkpoint-3"
    assert resolve_checkpoint("latest", tmp_path) == path
    state = json.loads((path / "ddp_ft_state.json").read_text())
    assert state["global_step"] == 3 and state["sample_in_epoch"] == 6 and state["world_size"] == 1
    assert state["format_version"] == ckpt.FORMAT_VERSION == 1 and not (path / "trainer_state.json").exists()
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
    assert not (tmp_path / "ddp_ft-checkpoint-6").exists() and not (tmp_path / "checkpoint-6").exists()
    assert resolve_checkpoint("latest", tmp_path) == good
    assert (good / "optimizer.pt").read_bytes() == before


def test_save_total_limit_keeps_the_newest(tmp_path):
    model, optimizer, scheduler = _parts()
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(step), DistInfo(), save_total_limit=2)
    assert sorted(p.name for p in tmp_path.glob("*checkpoint-*")) == ["ddp_ft-checkpoint-4", "ddp_ft-checkpoint-6"]


def test_resume_from_a_folder_that_is_not_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a ddp_ft checkpoint"):
        resolve_checkpoint(str(tmp_path), tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        resolve_checkpoint("latest", tmp_path / "nowhere")


def _trainer_checkpoint(folder):
    """A checkpoint as transformers.Trainer writes it: adapter files at the top, its own trainer_state.json."""
    folder.mkdir(parents=True)
    state = {"global_step": 3, "epoch": 0.5, "log_history": [{"loss": 7.4, "step": 1}], "best_metric": None,
             "max_steps": 16, "trial_params": None, "is_world_process_zero": True}  # fmt: skip
    (folder / "trainer_state.json").write_text(json.dumps(state))
    for name in ("adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (folder / name).write_bytes(b"trainer " + name.encode())
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_trainer_checkpoint_in_the_output_dir_is_neither_resumed_nor_pruned(tmp_path):
    trainer_files = _trainer_checkpoint(tmp_path / "checkpoint-3")
    model, optimizer, scheduler = _parts()
    saved = [
        save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(step), DistInfo(), save_total_limit=1)
        for step in (3, 4, 6)
    ]
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoint-3").iterdir()} == trainer_files
    assert resolve_checkpoint("latest", tmp_path) == saved[-1]
    assert [p.exists() for p in saved] == [False, False, True]  # the loop pruned its own, only its own


def test_resume_refuses_a_trainer_checkpoint_naming_the_path_and_what_it_is(tmp_path):
    _trainer_checkpoint(tmp_path / "checkpoint-3")
    with pytest.raises(ValueError) as error:
        resolve_checkpoint(str(tmp_path / "checkpoint-3"), tmp_path)
    message = str(error.value)
    assert str(tmp_path / "checkpoint-3") in message
    assert "Hugging Face Trainer checkpoint" in message and "recipes/qwen_ami.py" in message


def test_resume_refuses_a_checkpoint_of_another_format_version(tmp_path):
    model, optimizer, scheduler = _parts()
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3), DistInfo())
    state_file = path / ckpt.STATE_FILE
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "format_version": state["format_version"] + 1}))
    with pytest.raises(ValueError, match=rf"format_version {state['format_version'] + 1}.*{path}"):
        resolve_checkpoint("latest", tmp_path)


def test_replacing_a_same_step_checkpoint_that_fails_half_way_keeps_latest_on_a_complete_checkpoint(
    tmp_path, monkeypatch
):
    """Saving step 3 again (a resumed run, a re-run in the same folder) swaps folders: if the swap dies after the old
    one moved away, latest must still name a complete checkpoint holding the previous contents."""
    model, optimizer, scheduler = _parts()
    good = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3, 0, 6, 24), DistInfo())
    before = {p.relative_to(good): p.read_bytes() for p in good.rglob("*") if p.is_file()}
    real_replace = ckpt.os.replace

    def dies_moving_the_new_folder_in(src, dst):
        if Path(src).name.startswith(".tmp-") and Path(dst).name == good.name:
            raise OSError("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", dies_moving_the_new_folder_in)
    model.w.data += 1
    with pytest.raises(OSError, match="killed"):
        save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3, 0, 6, 24), DistInfo())
    monkeypatch.undo()
    latest = resolve_checkpoint("latest", tmp_path)
    assert {p.relative_to(latest): p.read_bytes() for p in latest.rglob("*") if p.is_file()} == before
    # the next save of the same step succeeds and leaves one complete checkpoint, latest on it
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3, 0, 6, 24), DistInfo())
    assert resolve_checkpoint("latest", tmp_path) == path == good
    assert torch.load(path / "adapter" / "adapter_model.pt")["w"].equal(model.w.data)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["latest", good.name])


def test_every_file_and_folder_is_fsynced_before_the_rename_that_publishes_it(tmp_path, monkeypatch):
    synced, events = set(), []
    real_fsync, real_replace = ckpt.os.fsync, ckpt.os.replace

    def fsync(fd):
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def replace(src, dst):
        src = Path(src)
        unsynced = [p for p in [src, *src.rglob("*")] if str(p.resolve()) not in synced]
        events.append((src.name, Path(dst).name, unsynced))
        real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "fsync", fsync)
    monkeypatch.setattr(ckpt.os, "replace", replace)
    model, optimizer, scheduler = _parts()
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3), DistInfo())
    monkeypatch.undo()
    published = {dst: unsynced for _, dst, unsynced in events}
    assert published[path.name] == [] and published["latest"] == [], events
    assert str(tmp_path.resolve()) in synced, "the rename itself is made durable by syncing the folder"
