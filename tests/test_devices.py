"""Which CUDA device each process takes (issue 11, item 4): a pure rule, and init_distributed following it, checked
on CPU with torch.cuda's queries monkeypatched."""

import pytest
import torch

from ddp_ft.distributed import cuda_device_index, init_distributed


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
def test_one_visible_gpu_is_cuda_0_otherwise_the_local_rank(local_rank, local_world_size, visible, expected):
    assert cuda_device_index(local_rank, local_world_size, visible) == expected


@pytest.mark.parametrize(("local_rank", "local_world_size", "visible"), [(2, 4, 2), (0, 4, 2), (2, 3, 2)])
def test_fewer_gpus_than_processes_but_more_than_one_is_an_error_naming_the_variables(
    local_rank, local_world_size, visible
):
    with pytest.raises(RuntimeError, match=rf"LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world_size} but "
                                           rf"{visible} CUDA devices .*--gpus-per-task=1"):  # fmt: skip
        cuda_device_index(local_rank, local_world_size, visible)


def test_init_distributed_puts_rank_1_on_cuda_0_when_it_sees_one_gpu(monkeypatch):
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
