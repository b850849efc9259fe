"""The cross-rank check at construction, as pure functions over each rank's description: no process group.

The distributed side (every rank raising on a real mismatch) is tested in test_wrapper.py.
"""

import torch
from torch import nn

from ddp_ft.ddp.buckets import ParamSpec, compute_bucket_assignment
from ddp_ft.ddp.verify import cross_rank_mismatch, describe_layout, describe_rank, first_layout_difference


def spec(name, numel, dtype=torch.float32, device="cpu"):
    return ParamSpec(name, numel, dtype, device, (numel,))


def test_layout_diff_names_first_differing_parameter():
    a = [spec("w1", 10), spec("w2", 20), spec("w3", 30)]
    b = [spec("w1", 10), ParamSpec("w2", 21, torch.float32, "cpu", (21,)), spec("w3", 30)]
    la = describe_layout(a, compute_bucket_assignment(a, 25, 25))
    lb = describe_layout(b, compute_bucket_assignment(b, 25, 25))
    assert first_layout_difference(la, la, other_rank=1) is None
    message = first_layout_difference(la, lb, other_rank=1)
    assert "'w2'" in message and "[20]" in message and "[21]" in message and "rank 1" in message


def test_layout_diff_names_extra_param_and_boundaries():
    a = [spec("w1", 10), spec("w2", 20)]
    b = a + [spec("extra", 5)]
    la = describe_layout(a, compute_bucket_assignment(a, 25, 25))
    lb = describe_layout(b, compute_bucket_assignment(b, 25, 25))
    assert "'extra'" in first_layout_difference(la, lb, other_rank=3)
    lc = describe_layout(a, compute_bucket_assignment(a, 1e-9, 1e-9))
    assert "bucket 0" in first_layout_difference(la, lc, other_rank=1)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.lora = nn.Linear(4, 2)
        self.ghost = nn.Parameter(torch.empty(3, device="meta"), requires_grad=False)


def _describe(model, cap_mb=25.0):
    specs = [ParamSpec.of(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return describe_rank(model, specs, compute_bucket_assignment(specs, cap_mb, cap_mb))


def test_rank_describes_layout_and_frozen_digests():
    described = _describe(_Model())
    assert described["layout"]["params"] == [
        ("lora.weight", (2, 4), "torch.float32"),
        ("lora.bias", (2,), "torch.float32"),
    ]
    assert [name for name, _ in described["frozen"]] == ["frozen.weight", "frozen.bias"]
    assert described == _describe(_Model()), "the same model describes itself the same way"


def test_equal_ranks_pass():
    assert cross_rank_mismatch([_describe(_Model())]) is None
    assert cross_rank_mismatch([_describe(_Model()) for _ in range(3)]) is None


def test_swapped_frozen_rows_name_param_rank_digests():
    other = _Model()
    with torch.no_grad():
        other.frozen.weight[[0, 1]] = other.frozen.weight[[1, 0]].clone()
    ranks = [_describe(_Model()), _describe(_Model()), _describe(other)]
    message = cross_rank_mismatch(ranks)
    digest_0, digest_2 = ranks[0]["frozen"][0][1], ranks[2]["frozen"][0][1]
    assert digest_0 != digest_2
    assert message.startswith("BucketedDDP: frozen parameter 'frozen.weight'"), message
    assert "between rank 0 and rank 2" in message and f"{digest_0[:12]} vs {digest_2[:12]}" in message, message


def test_a_missing_frozen_parameter_is_counted():
    ranks = [_describe(_Model()), _describe(_Model())]
    ranks[1]["frozen"] = ranks[1]["frozen"][:1]
    message = cross_rank_mismatch(ranks)
    assert "rank 0 has 2 frozen parameters, rank 1 1" in message, message


def test_layout_compared_before_frozen_weights():
    other = _Model()
    other.frozen.requires_grad_(True)  # trainable on rank 1 only: the layout differs, and so do the frozen lists
    message = cross_rank_mismatch([_describe(_Model()), _describe(other)])
    assert message.startswith("BucketedDDP: trainable parameters or buckets differ across ranks"), message
    assert "'frozen.weight'" in message and "rank 1" in message, message
    message = cross_rank_mismatch([_describe(_Model()), _describe(_Model(), cap_mb=1e-9)])
    assert "bucket 0" in message and "bucket_cap_mb" in message, message
