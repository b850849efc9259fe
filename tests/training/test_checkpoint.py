"""Checkpoints are atomic: a save that dies half-way loses nothing already saved; they load without executing code."""

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ddp_ft.distributed import DistInfo
from ddp_ft.training import checkpoint as ckpt
from ddp_ft.training.checkpoint import TrainState, resolve_checkpoint, save_checkpoint
from ddp_ft.training.data import DataLayout

from ..helpers.checkpoints import trainer_checkpoint, training_parts


def test_save_is_complete_and_latest_points_at_it(tmp_path):
    model, optimizer, scheduler = training_parts()
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3, 0, 6, 24), DistInfo())
    assert path == tmp_path / "ddp_ft-checkpoint-3"
    assert resolve_checkpoint("latest", tmp_path) == path
    state = json.loads((path / "ddp_ft_state.json").read_text())
    assert state["global_step"] == 3 and state["sample_in_epoch"] == 6 and state["world_size"] == 1
    assert state["format_version"] == ckpt.FORMAT_VERSION == 2 and not (path / "trainer_state.json").exists()
    assert not list(tmp_path.glob(".tmp-*"))


def test_failed_save_leaves_previous_and_latest_intact(tmp_path, monkeypatch):
    model, optimizer, scheduler = training_parts()
    good = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3, 0, 6, 24), DistInfo())
    before = (good / "optimizer.pt").read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(6, 0, 12, 48), DistInfo())
    monkeypatch.undo()
    assert not (tmp_path / "ddp_ft-checkpoint-6").exists() and not (tmp_path / "checkpoint-6").exists()
    assert resolve_checkpoint("latest", tmp_path) == good
    assert (good / "optimizer.pt").read_bytes() == before


def test_save_total_limit_keeps_the_newest(tmp_path):
    model, optimizer, scheduler = training_parts()
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(step), DistInfo(), save_total_limit=2)
    assert sorted(p.name for p in tmp_path.glob("*checkpoint-*")) == ["ddp_ft-checkpoint-4", "ddp_ft-checkpoint-6"]


def test_resume_from_a_non_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a ddp_ft checkpoint"):
        resolve_checkpoint(str(tmp_path), tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        resolve_checkpoint("latest", tmp_path / "nowhere")


def test_trainer_checkpoint_neither_resumed_nor_pruned(tmp_path):
    trainer_files = trainer_checkpoint(tmp_path / "checkpoint-3")
    model, optimizer, scheduler = training_parts()
    saved = [
        save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(step), DistInfo(), save_total_limit=1)
        for step in (3, 4, 6)
    ]
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoint-3").iterdir()} == trainer_files
    assert resolve_checkpoint("latest", tmp_path) == saved[-1]
    assert [p.exists() for p in saved] == [False, False, True]  # the loop pruned its own, only its own


def test_resume_refuses_trainer_checkpoint_naming_it(tmp_path):
    trainer_checkpoint(tmp_path / "checkpoint-3")
    with pytest.raises(ValueError) as error:
        resolve_checkpoint(str(tmp_path / "checkpoint-3"), tmp_path)
    message = str(error.value)
    assert str(tmp_path / "checkpoint-3") in message
    assert "Hugging Face Trainer checkpoint" in message and "recipes/qwen_ami.py" in message


def test_recipe_logs_the_resumed_step_once_on_rank_0(tmp_path, caplog):
    from ddp_ft.integrations.recipe import log_resume

    trainer_checkpoint(tmp_path / "checkpoint-3")
    with caplog.at_level("INFO", logger="ddp_ft.integrations.recipe"):
        for checkpoint, rank in ((tmp_path / "checkpoint-3", 1), (None, 0), (tmp_path / "checkpoint-3", 0)):
            log_resume(checkpoint, DistInfo(rank=rank, world_size=2))
    said = [r.getMessage() for r in caplog.records if r.name == "ddp_ft.integrations.recipe"]
    assert said == [f"resuming from {tmp_path / 'checkpoint-3'} at step 3"]


def test_loop_warns_of_powersgd_on_resume_on_rank_0(caplog):
    """PowerSGD's state is not checkpointed: the loop's resume says so once, on rank 0, not once per rank."""
    from ddp_ft.training.config import parse_settings
    from ddp_ft.training.run import _log_resume

    settings = parse_settings(["--preset", "tiny", "--comm-hook", "powersgd"])
    with caplog.at_level("WARNING", logger="ddp_ft.training.run"):
        for rank in (1, 0):
            _log_resume(settings, Path("run/ddp_ft-checkpoint-2"), TrainState(2), DistInfo(rank=rank, world_size=2))
    assert ["PowerSGD's state" in r.getMessage() for r in caplog.records] == [True]


def test_resume_refuses_a_newer_format_version(tmp_path):
    model, optimizer, scheduler = training_parts()
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3), DistInfo())
    state_file = path / ckpt.STATE_FILE
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "format_version": state["format_version"] + 1}))
    with pytest.raises(ValueError, match=rf"format_version {state['format_version'] + 1}.*{path}"):
        resolve_checkpoint("latest", tmp_path)


def test_failed_same_step_resave_keeps_latest_complete(tmp_path, monkeypatch):
    """Saving step 3 again (a resumed run, a re-run in the same folder) swaps folders: if the swap dies after the old
    one moved away, latest must still name a complete checkpoint holding the previous contents."""
    model, optimizer, scheduler = training_parts()
    good = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3, 0, 6, 24), DistInfo())
    before = {p.relative_to(good): p.read_bytes() for p in good.rglob("*") if p.is_file()}
    real_replace = os.replace

    def dies_moving_the_new_folder_in(src, dst):
        if Path(src).name.startswith(".tmp-") and Path(dst).name == good.name:
            raise OSError("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dies_moving_the_new_folder_in)
    model.w.data += 1
    with pytest.raises(OSError, match="killed"):
        save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3, 0, 6, 24), DistInfo())
    monkeypatch.undo()
    latest = resolve_checkpoint("latest", tmp_path)
    assert {p.relative_to(latest): p.read_bytes() for p in latest.rglob("*") if p.is_file()} == before
    # the next save of the same step succeeds and leaves one complete checkpoint, latest on it
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3, 0, 6, 24), DistInfo())
    assert resolve_checkpoint("latest", tmp_path) == path == good
    assert load_file(path / "adapter" / "adapter_model.safetensors")["w"].equal(model.w.data)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["latest", good.name])


def test_all_fsynced_before_the_rename_publishing_it(tmp_path, monkeypatch):
    synced, events = set(), []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def replace(src, dst):
        src = Path(src)
        unsynced = [p for p in [src, *src.rglob("*")] if str(p.resolve()) not in synced]
        events.append((src.name, Path(dst).name, unsynced))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    model, optimizer, scheduler = training_parts()
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3), DistInfo())
    monkeypatch.undo()
    published = {dst: unsynced for _, dst, unsynced in events}
    assert published[path.name] == [] and published["latest"] == [], events
    assert str(tmp_path.resolve()) in synced, "the rename itself is made durable by syncing the folder"


def _draws():
    """The next values of every generator a resumed run continues, the cached Gaussians included."""
    return (
        random.random(),
        random.gauss(0, 1),
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.standard_normal(2).tolist(),
        torch.rand(3).tolist(),
    )


def _seed_with_cached_gaussians(seed):
    """Seed all generators and draw one Gaussian each, so Python's gauss_next and numpy's cached_gaussian are set."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    random.gauss(0, 1)
    np.random.standard_normal()
    assert random.getstate()[2] is not None and np.random.get_state()[3] == 1


def _snapshot():
    return random.getstate(), np.random.get_state(), torch.random.get_rng_state()


def _restore(snapshot):
    python, numpy, cpu = snapshot
    random.setstate(python)
    np.random.set_state(numpy)
    torch.random.set_rng_state(cpu)


def _plain(value) -> bool:
    """Only tensors and plain Python data, all that torch.load(weights_only=True) reads without an allowlist."""
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (torch.Tensor, bool, int, float, str))


def test_rng_states_are_plain_data_and_restore_exactly(tmp_path):
    model, optimizer, scheduler = training_parts()
    _seed_with_cached_gaussians(7)
    before = _snapshot()
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3), DistInfo())
    _restore(before)
    expected = _draws()

    states = torch.load(path / "rng_states.pt", weights_only=True)  # the old format (pickled numpy arrays) fails here
    assert len(states) == 1 and _plain(states)
    _seed_with_cached_gaussians(123)
    ckpt.set_rng_state(states[0])
    assert _draws() == expected


def _peft_parts():
    """A tiny real peft model with the loop's optimizer and schedule (AdamW, transformers' cosine with min lr)."""
    from peft import LoraConfig, get_peft_model
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    torch.manual_seed(0)  # the same frozen base every call; only the adapter is saved
    base = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["0", "2"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, 2, 10, min_lr=1e-4)
    return model, optimizer, scheduler


def _adapter(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_load_is_weights_only_restores_optim_and_rng(tmp_path, monkeypatch):
    model, optimizer, scheduler = _peft_parts()
    for _ in range(3):
        model(torch.randn(5, 4)).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    _seed_with_cached_gaussians(7)
    before = _snapshot()
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3, 0, 6, 24), DistInfo())
    _restore(before)
    expected_draws = _draws()
    for name in ckpt.TENSOR_FILES:
        assert _plain(torch.load(path / name, weights_only=True)), name
    ckpt.verify_checkpoint(path)

    fresh_model, fresh_optimizer, fresh_scheduler = _peft_parts()
    loads, real_load = [], torch.load

    def recording_load(*args, **kwargs):
        loads.append((Path(args[0]).name, kwargs.get("weights_only")))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    _seed_with_cached_gaussians(123)
    state = ckpt.load_checkpoint(path, fresh_model, fresh_optimizer, fresh_scheduler, DistInfo())
    draws = _draws()
    monkeypatch.undo()

    assert sorted(loads) == sorted((name, True) for name in ckpt.TENSOR_FILES)
    assert draws == expected_draws
    assert state == TrainState(3, 0, 6, 24)
    torch.testing.assert_close(_adapter(fresh_model), _adapter(model), rtol=0, atol=0)
    torch.testing.assert_close(fresh_optimizer.state_dict(), optimizer.state_dict(), rtol=0, atol=0)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    scheduler.step()
    fresh_scheduler.step()
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()


_RAN_ON_LOAD = []


def _ran_on_load():
    _RAN_ON_LOAD.append(True)
    return {}


class _Payload:
    """Pickles as a call of ``_ran_on_load``: loading it with pickle runs code."""

    def __reduce__(self):
        return (_ran_on_load, ())


@pytest.mark.parametrize(
    "name, content, found",
    [
        ("rng_states.pt", lambda: [{"numpy": np.random.get_state()}], "numpy"),  # what format_version 1 wrote
        ("optimizer.pt", lambda: {"state": {}, "param_groups": [], "hook": _Payload()}, "_ran_on_load"),
    ],
)
def test_verify_refuses_pickles_unrun_naming_the_file(tmp_path, name, content, found):
    model, optimizer, scheduler = training_parts()
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3), DistInfo())
    torch.save(content(), path / name)
    with pytest.raises(ValueError) as error:
        ckpt.verify_checkpoint(path)
    message = str(error.value)
    assert str(path / name) in message and found in message, message
    assert "without executing code" in message and "--output-dir" in message, message
    assert _RAN_ON_LOAD == []


def test_verify_refuses_adapter_bin_for_safetensors(tmp_path):
    model, optimizer, scheduler = training_parts()
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3), DistInfo())
    adapter = path / ckpt.ADAPTER_DIR
    torch.save(model.state_dict(), adapter / "adapter_model.bin")
    with pytest.raises(ValueError, match=rf"{adapter / 'adapter_model.bin'} is a pickled file.*safetensors"):
        ckpt.verify_checkpoint(path)
    (adapter / "adapter_model.bin").unlink()
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="adapter/adapter_model.safetensors"):
        ckpt.verify_checkpoint(path)


def test_verify_refuses_a_truncated_file_naming_it(tmp_path):
    model, optimizer, scheduler = training_parts()
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3), DistInfo())
    data = (path / "optimizer.pt").read_bytes()
    (path / "optimizer.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{path / 'optimizer.pt'} cannot be read as a torch.save file"):
        ckpt.verify_checkpoint(path)


def test_loop_refuses_pickles_before_the_model_loads(tmp_path):
    from ddp_ft.training.checkpoint import check_resume_position

    layout = DataLayout(train_samples=16, seed=0, effective_batch=2, world_size=1, micro_batch=1)
    model, optimizer, scheduler = training_parts()
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3, 0, 6, 6), DistInfo(), layout=layout)
    check_resume_position(path, layout)  # a checkpoint this version wrote passes
    torch.save([{"numpy": np.random.get_state()}], path / "rng_states.pt")
    with pytest.raises(ValueError, match=rf"{path / 'rng_states.pt'} holds pickled objects"):
        check_resume_position(path, layout)


def test_resume_refuses_format_1_of_older_ddp_ft(tmp_path):
    """Format 1 stored numpy's RNG state as pickled numpy objects, which this version does not load."""
    model, optimizer, scheduler = training_parts()
    path = save_checkpoint(tmp_path, model, optimizer, scheduler, TrainState(3), DistInfo())
    state_file = path / ckpt.STATE_FILE
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "format_version": 1}))
    with pytest.raises(ValueError) as error:
        resolve_checkpoint("latest", tmp_path)
    message = str(error.value)
    assert f"format_version 1, but this ddp_ft reads format_version {ckpt.FORMAT_VERSION} only" in message
    assert f"{path} was written by another ddp_ft version" in message and "--output-dir" in message, message


def test_partial_final_saves_are_cleaned(tmp_path):
    """What a save of ``final/`` killed half-way leaves (its temporary folder, or the old one being removed)."""
    for name in (".tmp-final", ".trash-final"):
        (tmp_path / name).mkdir()
    assert sorted(ckpt.clean_partial_saves(tmp_path)) == [".tmp-final", ".trash-final"]
    assert not list(tmp_path.iterdir())
