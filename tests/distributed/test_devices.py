"""Which CUDA device and backend each process takes: pure rules, and init_distributed following them, checked
on CPU with torch.cuda's queries monkeypatched."""

import pytest
import torch

from ddp_ft.distributed import init_distributed
from ddp_ft.distributed.devices import check_local_gpus, choose_device, cuda_device_index


@pytest.mark.parametrize(
    ("local_rank", "local_world_size", "visible", "expected"),
    [
        (0, 1, 1, 0),  # one process, one GPU
        (1, 2, 1, 0),  # SLURM --gpus-per-task=1 / a device plugin: each process sees only its own GPU
        (3, 4, 1, 0),
        (1, 2, 2, 1),  # torchrun on a 2-GPU host: every process sees both
        (1, 2, 8, 1),  # more GPUs than processes
    ],
)
def test_one_gpu_is_cuda_0_otherwise_the_local_rank(local_rank, local_world_size, visible, expected):
    assert cuda_device_index(local_rank, local_world_size, visible) == expected


@pytest.mark.parametrize(("local_rank", "local_world_size", "visible"), [(2, 4, 2), (0, 4, 2), (2, 3, 2)])
def test_some_but_too_few_gpus_raise_naming_variables(local_rank, local_world_size, visible):
    with pytest.raises(
        RuntimeError,
        match=rf"LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world_size} but "
        rf"{visible} CUDA devices .*--gpus-per-task=1",
    ):
        cuda_device_index(local_rank, local_world_size, visible)


def test_gloo_on_too_few_gpus_names_one_visible_gpu():
    with pytest.raises(RuntimeError, match=r"LOCAL_WORLD_SIZE=3 but 2 CUDA .*only when exactly one.*=0.*at most 2"):
        cuda_device_index(2, 3, 2, backend="gloo")


CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("device", "backend", "cuda", "visible", "local_rank", "local_world_size", "expected"),
    [
        ("auto", "auto", False, 0, 1, 2, (torch.device("cpu"), "gloo")),  # today's default, on the CPU
        ("auto", "auto", True, 2, 1, 2, (torch.device("cuda", 1), "nccl")),  # and on CUDA
        ("auto", "gloo", False, 0, 1, 2, (torch.device("cpu"), "gloo")),
        ("auto", "gloo", True, 2, 1, 2, (torch.device("cuda", 1), "gloo")),  # enough GPUs: one each
        ("auto", "gloo", True, 1, 1, 2, (CUDA, "gloo")),  # one visible: the ranks share cuda:0
        ("auto", "gloo", True, 1, 3, 4, (CUDA, "gloo")),
        ("cpu", "gloo", True, 1, 1, 2, (torch.device("cpu"), "gloo")),  # CUDA there but not asked for
        ("auto", "nccl", True, 2, 0, 2, (CUDA, "nccl")),
        ("cuda", "auto", True, 1, 1, 2, (CUDA, "nccl")),  # SLURM --gpus-per-task=1: its own GPU
    ],
)
def test_device_and_backend_follow_request_and_gpus(
    device, backend, cuda, visible, local_rank, local_world_size, expected
):
    assert choose_device(device, backend, cuda, visible, local_rank, local_world_size) == expected


@pytest.mark.parametrize(
    ("device", "backend", "cuda", "visible", "error", "match"),
    [
        ("auto", "nccl", False, 0, ValueError, r"--backend nccl but torch.cuda.is_available\(\) .*--backend gloo"),
        ("cpu", "nccl", True, 1, ValueError, r"--backend nccl but --device cpu: NCCL reduces CUDA tensors only"),
        ("auto", "mpi", True, 1, ValueError, r"--backend 'mpi': choose one of auto, nccl, gloo"),
        ("auto", "gloo", True, 2, RuntimeError, r"over gloo .* exactly one is visible"),  # 3 ranks, 2 GPUs
        ("cuda", "auto", False, 0, ValueError, r"--device cuda but torch.cuda.is_available\(\) is False"),
        ("gpu", "auto", True, 1, ValueError, r"--device 'gpu': choose one of auto, cuda, cpu"),
    ],
)
def test_impossible_device_or_backend_refused(device, backend, cuda, visible, error, match):
    with pytest.raises(error, match=match):
        choose_device(device, backend, cuda, visible, local_rank=2, local_world_size=3)


def test_launcher_refuses_ranks_nccl_cannot_place():
    """Every process of ``ddp-ft --nproc N`` sees the launcher's GPUs, so N above them means sharing."""
    check_local_gpus(2, 2, "nccl")
    check_local_gpus(2, 1, "gloo")  # both on cuda:0, by choice
    check_local_gpus(1, 1, "nccl")
    with pytest.raises(ValueError, match=r"2 processes but 1 GPU\(s\) visible: NCCL .*--backend gloo with one GPU"):
        check_local_gpus(2, 1, "nccl")
    with pytest.raises(ValueError, match=r"3 processes sharing a GPU over gloo, but 2 .*CUDA_VISIBLE_DEVICES=0"):
        check_local_gpus(3, 2, "gloo")


def test_rank_1_seeing_one_gpu_takes_cuda_0(monkeypatch):
    """The launcher gave LOCAL_RANK=1 its own GPU: it was refused ('only 1 CUDA devices') and the device map pointed
    at cuda:1. Now the process takes cuda:0 (one process here: no process group is needed to see the choice)."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "1")
    info = init_distributed()
    assert chosen == [0] and info.device == torch.device("cuda", 0)


@pytest.fixture
def two_ranks_on_one_visible_gpu(rank_1_of_2, monkeypatch):
    """Rank 1 of 2 on a host (mocked) where the launcher gave each process one GPU; init_process_group recorded."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    return rank_1_of_2


def test_nccl_group_bound_to_device_with_timeout(two_ranks_on_one_visible_gpu):
    """``device_id`` makes NCCL create its communicator at once and gives barriers this device; before, the
    group was unbound and a barrier guessed ``cuda:<rank % device count>``."""
    from datetime import timedelta

    info = init_distributed(timeout_s=123)
    (call,) = two_ranks_on_one_visible_gpu
    assert call["backend"] == "nccl" and call["timeout"] == timedelta(seconds=123)
    assert call["device_id"] == torch.device("cuda", 0) == info.device


def test_gloo_ranks_share_the_one_gpu_unbound(two_ranks_on_one_visible_gpu):
    """``backend="gloo"``: rank 1 takes cuda:0 beside rank 0, and gloo's group is not bound to it."""
    info = init_distributed("gloo")
    (call,) = two_ranks_on_one_visible_gpu
    assert call["backend"] == "gloo" == info.backend and "device_id" not in call
    assert info.device == torch.device("cuda", 0)


@pytest.mark.parametrize(
    "entry_point,body",
    [("scripts/train.py", "ddp_ft.commands.train"), ("recipes/qwen_ami.py", "ddp_ft.commands.recipe")],
)
def test_entry_points_start_group_with_ddp_timeout(entry_point, body, monkeypatch):
    """``--ddp-timeout`` and ``--backend`` reach init_process_group on both entry points (the recipe starts the group
    itself, before Accelerate, which then adopts it)."""
    import importlib
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("entry", Path(__file__).parents[2] / entry_point)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen = []

    def init_distributed(backend, timeout_s):
        seen.append((backend, timeout_s))
        raise KeyboardInterrupt  # stop there: nothing else is under test

    monkeypatch.setattr(importlib.import_module(body), "init_distributed", init_distributed)  # the script's main
    with pytest.raises(KeyboardInterrupt):
        module.main(["--preset", "tiny", "--ddp-timeout", "77", "--backend", "gloo"])
    assert seen == [("gloo", 77)]


def test_the_trainer_s_barrier_names_no_device_index(monkeypatch):
    """Accelerate's ``wait_for_everyone`` passes ``device_ids=[local_process_index]``, which is ``cuda:1`` on a rank
    that sees one GPU (``cuda:0``); BucketedTrainer's checkpoint barriers go through ours, which uses the bound group."""
    import torch.distributed as dist

    from ddp_ft.integrations.accelerate import BucketedAccelerator

    barriers = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda *args, **kwargs: barriers.append((args, kwargs)))
    accelerator = BucketedAccelerator.__new__(BucketedAccelerator)
    monkeypatch.setattr(BucketedAccelerator, "num_processes", property(lambda self: 2))
    accelerator.wait_for_everyone()
    assert barriers == [((), {})]


def test_going_first_waits_at_the_same_barrier(monkeypatch):
    """``main_process_first`` and ``local_main_process_first`` wait at that barrier too, not Accelerate's: a rank
    that does not go first waits before the block, one that does waits after it."""
    import torch.distributed as dist

    from ddp_ft.integrations.accelerate import BucketedAccelerator

    barriers, seen = [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda *args, **kwargs: barriers.append((args, kwargs)))
    monkeypatch.setattr(BucketedAccelerator, "num_processes", property(lambda self: 2))
    monkeypatch.setattr(BucketedAccelerator, "is_main_process", property(lambda self: False))
    monkeypatch.setattr(BucketedAccelerator, "is_local_main_process", property(lambda self: True))
    accelerator = BucketedAccelerator.__new__(BucketedAccelerator)
    with accelerator.main_process_first():
        seen.append(len(barriers))
    with accelerator.local_main_process_first():
        seen.append(len(barriers))
    assert seen == [1, 1] and barriers == [((), {})] * 2


def test_suite_hides_cuda_from_its_processes():
    """On a GPU host the CPU suite's launches inherited CUDA (2 processes on 1 GPU failed with 'LOCAL_RANK=1
    but only 1 CUDA devices'; on 2 GPUs they took NCCL and CUDA metrics). ``cuda`` tests get it back explicitly."""
    import os
    import subprocess
    import sys

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()
    probe = "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "''"
