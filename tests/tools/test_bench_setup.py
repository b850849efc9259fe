"""Benchmarks pick device, backend and compute dtype together, checked on CPU with torch.cuda's
queries monkeypatched: bench_ddp.py joined NCCL on a CUDA host with its model on the CPU, and computed in bf16 on
any GPU."""

import pytest
import torch
import torch.distributed as dist

from ddp_ft.tools.bench import compute_setup


def _mock_cuda(monkeypatch, capability, set_device=None):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", set_device or (lambda index: None))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize(("capability", "dtype"), [((8, 0), torch.bfloat16), ((7, 5), torch.float16)])
def test_cuda_host_uses_rank_gpu_nccl_and_card_dtype(rank_1_of_2, monkeypatch, capability, dtype):
    _mock_cuda(monkeypatch, capability)
    setup = compute_setup("auto", "auto")
    (call,) = rank_1_of_2
    assert call["backend"] == "nccl" == setup.backend and call["device_id"] == torch.device("cuda", 1)
    assert setup.info.device == torch.device("cuda", 1) and setup.device_map == {"": 1}
    assert setup.precision.dtype == dtype and setup.precision.autocast


def test_device_cpu_on_cuda_host_is_gloo_float32(rank_1_of_2, monkeypatch):
    touched = []
    _mock_cuda(monkeypatch, (9, 0), set_device=touched.append)
    setup = compute_setup("cpu", "auto")
    (call,) = rank_1_of_2
    assert call["backend"] == "gloo" == setup.backend and "device_id" not in call
    assert setup.info.device == torch.device("cpu") and setup.device_map == {"": "cpu"}
    assert setup.precision.dtype == torch.float32 and not setup.precision.autocast
    assert touched == []


def test_without_cuda_auto_is_the_cpu_with_gloo(rank_1_of_2, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    setup = compute_setup("auto", "auto")
    assert rank_1_of_2[0]["backend"] == "gloo" and setup.device_map == {"": "cpu"}
    assert setup.precision.dtype == torch.float32


def test_bfloat16_on_older_gpu_refused_naming_fix(rank_1_of_2, monkeypatch):
    _mock_cuda(monkeypatch, (7, 5))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    with pytest.raises(ValueError, match="compute capability 7.5.*--compute-dtype float16"):
        compute_setup("cuda", "bfloat16")
