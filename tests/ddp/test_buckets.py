"""Bucket assignment is a pure function: reverse registration order, dtype/device split, caps."""

import pytest
import torch

from ddp_ft.ddp.buckets import MB, ParamSpec, compute_bucket_assignment


def spec(name, numel, dtype=torch.float32, device="cpu"):
    return ParamSpec(name, numel, dtype, device, (numel,))


def test_first_bucket_filled_from_last_parameter():
    params = [spec(f"p{i}", 1000) for i in range(6)]  # 4000 bytes each
    buckets = compute_bucket_assignment(params, bucket_cap_mb=8000 / MB, first_bucket_cap_mb=4000 / MB)
    assert [b.param_indices for b in buckets] == [(5,), (4, 3), (2, 1), (0,)]
    assert [b.offsets for b in buckets] == [(0,), (0, 1000), (0, 1000), (0,)]
    assert [b.numel for b in buckets] == [1000, 2000, 2000, 1000]


def test_each_parameter_in_one_bucket_contiguously():
    sizes = [7, 300, 1, 5000, 42, 42, 900, 3]
    params = [spec(f"p{i}", n) for i, n in enumerate(sizes)]
    buckets = compute_bucket_assignment(params, bucket_cap_mb=2000 / MB, first_bucket_cap_mb=100 / MB)
    seen = sorted(i for b in buckets for i in b.param_indices)
    assert seen == list(range(len(sizes)))
    for b in buckets:
        expected, total = [], 0
        for i in b.param_indices:
            expected.append(total)
            total += sizes[i]
        assert list(b.offsets) == expected and b.numel == total
    assert [b.index for b in buckets] == list(range(len(buckets)))


def test_parameter_larger_than_cap_gets_its_own_bucket():
    params = [spec("small_a", 10), spec("huge", 10_000), spec("small_b", 10)]
    buckets = compute_bucket_assignment(params, bucket_cap_mb=100 / MB, first_bucket_cap_mb=100 / MB)
    assert [b.param_indices for b in buckets] == [(2, 1), (0,)]


def test_tiny_cap_one_per_bucket_huge_cap_one_bucket():
    params = [spec(f"p{i}", 10 + i) for i in range(5)]
    assert len(compute_bucket_assignment(params, 1e-9, 1e-9)) == 5
    one = compute_bucket_assignment(params, 25, 25)
    assert len(one) == 1 and one[0].param_indices == (4, 3, 2, 1, 0)


def test_dtypes_and_devices_never_share_a_bucket():
    params = [
        spec("a", 10, torch.float32),
        spec("b", 10, torch.bfloat16),
        spec("c", 10, torch.float32),
        spec("d", 10, torch.float32, device="meta"),
    ]
    buckets = compute_bucket_assignment(params, 25, 25)
    groups = {(b.dtype, b.device): b.param_indices for b in buckets}
    assert groups == {(torch.float32, "meta"): (3,), (torch.float32, "cpu"): (2, 0), (torch.bfloat16, "cpu"): (1,)}
    # launch order follows the reversed walk: d's bucket is met first, then c's, then b's
    assert [b.param_indices for b in buckets] == [(3,), (2, 0), (1,)]


def test_bucket_sizes_in_bytes_respect_dtype_width():
    # 1000 bf16 elements are 2000 bytes: two of them fit a 4000-byte first bucket, fp32 ones would not.
    params = [spec(f"p{i}", 1000, torch.bfloat16) for i in range(3)]
    buckets = compute_bucket_assignment(params, bucket_cap_mb=4000 / MB, first_bucket_cap_mb=4000 / MB)
    assert [b.param_indices for b in buckets] == [(2, 1), (0,)]


@pytest.mark.parametrize("cap,first", [(0, 1), (1, 0), (-1, 1)])
def test_non_positive_caps_are_rejected(cap, first):
    with pytest.raises(ValueError, match="cap_mb"):
        compute_bucket_assignment([spec("a", 1)], cap, first)
