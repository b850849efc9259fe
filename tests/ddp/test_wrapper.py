"""BucketedDDP against torch DDP and a single process on the global batch: 2 real gloo processes."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.testing import assert_close

from ddp_ft.ddp import BucketedDDP

from ..helpers.dist_harness import gather_tensors, run_distributed
from ..helpers.models import Net, local_slice, make_batch

pytestmark = pytest.mark.distributed

MB = 1024 * 1024
CAPS = {
    "one_param_per_bucket": (1e-9, 1e-9),
    "a_few_buckets": (5000 / MB, 1000 / MB),
    "one_bucket": (25.0, 25.0),
}


def assert_same_on_all_ranks(tensors):
    copies = gather_tensors(tensors)
    for rank_copy in copies[1:]:
        for a, b in zip(copies[0], rank_copy, strict=True):
            assert torch.equal(a, b), "parameters differ across ranks"


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def _params(model):
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


def _against_references(rank, world_size, cap, first_cap, grad_view, steps=3):
    torch.manual_seed(0)
    reference = Net()
    ours = BucketedDDP(
        copy.deepcopy(reference), bucket_cap_mb=cap, first_bucket_cap_mb=first_cap, gradient_as_bucket_view=grad_view
    )
    theirs = TorchDDP(copy.deepcopy(reference))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs, reference)]
    local = local_slice(rank, world_size)
    n_trainable = sum(p.requires_grad for p in reference.parameters())
    buckets = len(ours.bucket_sizes)
    for step in range(steps):
        x, y = make_batch(step)
        for model in (ours, theirs):
            torch.nn.functional.mse_loss(model(x[local]), y[local]).backward()
        torch.nn.functional.mse_loss(reference(x), y).backward()  # one process, global batch

        assert ours.last_comm_stats().allreduce_calls == buckets
        for g_ours, g_torch, g_ref in zip(_grads(ours.module), _grads(theirs.module), _grads(reference), strict=True):
            assert_close(g_ours, g_torch, rtol=0, atol=0)
            assert_close(g_ours, g_ref, rtol=1e-6, atol=1e-7)
        if grad_view:
            buffers = ours.bucket_buffers
            for p in ours.module.parameters():
                if p.requires_grad:
                    assert any(
                        buf.data_ptr() <= p.grad.data_ptr() < buf.data_ptr() + buf.numel() * buf.element_size()
                        for buf in buffers
                    ), "grad is not a view into its bucket"
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert_same_on_all_ranks(_params(ours.module))
        for p_ours, p_ref in zip(_params(ours.module), _params(reference), strict=True):
            assert_close(p_ours, p_ref, rtol=1e-6, atol=1e-7)
    return {"buckets": buckets, "n_trainable": n_trainable}


@pytest.mark.parametrize("grad_view", [True, False], ids=["grad_as_bucket_view", "grad_copies"])
@pytest.mark.parametrize("caps", CAPS.values(), ids=CAPS.keys())
def test_gradients_equal_torch_ddp_and_one_process(caps, grad_view):
    results = run_distributed(_against_references, *caps, grad_view)
    n_buckets, n_trainable = results[0]["buckets"], results[0]["n_trainable"]
    if caps == CAPS["one_param_per_bucket"]:
        assert n_buckets == n_trainable
    elif caps == CAPS["one_bucket"]:
        assert n_buckets == 1
    else:
        assert 1 < n_buckets < n_trainable


def _no_sync_accumulation(rank, world_size, grad_view, micro_steps=3):
    torch.manual_seed(0)
    reference = Net()
    ours = BucketedDDP(
        copy.deepcopy(reference),
        bucket_cap_mb=5000 / MB,
        first_bucket_cap_mb=1000 / MB,
        gradient_as_bucket_view=grad_view,
    )
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, reference)]
    local = local_slice(rank, world_size)
    buckets = len(ours.bucket_sizes)
    calls_per_backward = []
    for step in range(2):
        for micro in range(micro_steps):
            x, y = make_batch(10 * step + micro)
            last = micro == micro_steps - 1
            if last:
                torch.nn.functional.mse_loss(ours(x[local]), y[local]).backward()
            else:
                with ours.no_sync():
                    torch.nn.functional.mse_loss(ours(x[local]), y[local]).backward()
                copies = gather_tensors(_grads(ours.module))
                assert any(not torch.equal(a, b) for a, b in zip(copies[0], copies[1], strict=True)), (
                    "gradients agree across ranks inside no_sync: something communicated"
                )
            calls_per_backward.append(ours.last_comm_stats().allreduce_calls)
            torch.nn.functional.mse_loss(reference(x), y).backward()
        step_stats = ours.pop_comm_stats()
        assert step_stats.allreduce_calls == buckets and step_stats.backwards == micro_steps
        assert_same_on_all_ranks(_grads(ours.module))
        for g_ours, g_ref in zip(_grads(ours.module), _grads(reference), strict=True):
            assert_close(g_ours, g_ref, rtol=1e-6, atol=1e-7)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return calls_per_backward, buckets


@pytest.mark.parametrize("grad_view", [True, False], ids=["grad_as_bucket_view", "grad_copies"])
def test_no_sync_sends_nothing_then_sync_reduces_sum(grad_view):
    calls, buckets = run_distributed(_no_sync_accumulation, grad_view)[0]
    assert calls == [0, 0, buckets, 0, 0, buckets]


def _unused_parameter(rank, world_size, find_unused):
    torch.manual_seed(0)
    model = BucketedDDP(Net(unused_branch=True), find_unused_parameters=find_unused)
    x, y = make_batch(0)
    local = local_slice(rank, world_size)
    try:
        torch.nn.functional.mse_loss(model(x[local]), y[local]).backward()
    except RuntimeError as error:
        return str(error)
    grads = {n: p.grad for n, p in model.module.named_parameters() if p.requires_grad}
    # unused on every rank: no gradient at all (as torch DDP), so an optimizer skips it
    assert grads.pop("unused.weight") is None and grads.pop("unused.bias") is None
    assert_same_on_all_ranks(list(grads.values()))
    # training continues: the next backward uses the branch and it is reduced as usual
    model.module.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x[local], use_unused=True), y[local]).backward()
    assert torch.count_nonzero(model.module.unused.weight.grad) > 0
    return None


def test_unused_parameter_raises_naming_it_every_rank():
    for message in run_distributed(_unused_parameter, False):
        assert message is not None and "'unused.weight'" in message and "find_unused_parameters=True" in message


def test_find_unused_gives_unused_parameter_no_grad():
    assert run_distributed(_unused_parameter, True) == [None, None]


def _unused_in_the_synced_step(rank, world_size, grad_view):
    torch.manual_seed(0)
    reference = Net(unused_branch=True)
    ours = BucketedDDP(
        copy.deepcopy(reference),
        find_unused_parameters=True,
        gradient_as_bucket_view=grad_view,
        bucket_cap_mb=5000 / MB,
        first_bucket_cap_mb=1000 / MB,
    )
    theirs = TorchDDP(copy.deepcopy(reference), find_unused_parameters=True)
    local = local_slice(rank, world_size)
    (x0, y0), (x1, y1) = make_batch(0), make_batch(1)
    for model in (ours, theirs):
        with model.no_sync():  # the branch is used in the accumulation micro-step ...
            torch.nn.functional.mse_loss(model(x0[local], use_unused=True), y0[local]).backward()
        torch.nn.functional.mse_loss(model(x1[local]), y1[local]).backward()  # ... and not in the synced one
    torch.nn.functional.mse_loss(reference(x0, use_unused=True), y0).backward()
    torch.nn.functional.mse_loss(reference(x1), y1).backward()
    assert torch.count_nonzero(ours.module.unused.weight.grad) > 0
    assert_same_on_all_ranks(_grads(ours.module))
    for (name, p_ours), p_torch, p_ref in zip(
        ours.module.named_parameters(), theirs.module.parameters(), reference.parameters(), strict=True
    ):
        if p_ours.requires_grad:
            assert_close(p_ours.grad, p_torch.grad, rtol=0, atol=0, msg=name)
            assert_close(p_ours.grad, p_ref.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("grad_view", [True, False], ids=["grad_as_bucket_view", "grad_copies"])
def test_find_unused_reduces_grads_from_no_sync_steps(grad_view):
    """A parameter used only in no_sync micro-steps contributes its accumulated gradient to the synced step's
    average (not zero), exactly as torch DDP and as one process on the global batch."""
    run_distributed(_unused_in_the_synced_step, grad_view)


def _used_on_one_rank_only(rank, world_size):
    torch.manual_seed(0)
    reference = Net(unused_branch=True)
    ours = BucketedDDP(copy.deepcopy(reference), find_unused_parameters=True)
    theirs = TorchDDP(copy.deepcopy(reference), find_unused_parameters=True)
    x, y = make_batch(0)
    local = local_slice(rank, world_size)
    for model in (ours, theirs):
        torch.nn.functional.mse_loss(model(x[local], use_unused=rank == 0), y[local]).backward()
    for (name, p_ours), p_torch in zip(ours.module.named_parameters(), theirs.module.parameters(), strict=True):
        if p_ours.requires_grad:
            assert_close(p_ours.grad, p_torch.grad, rtol=0, atol=0, msg=name)


def test_parameter_used_on_one_rank_matches_torch_ddp():
    run_distributed(_used_on_one_rank_only)


def _globally_unused_under_adamw(rank, world_size, grad_view):
    torch.manual_seed(0)
    reference = Net(unused_branch=True)
    ours = BucketedDDP(
        copy.deepcopy(reference),
        find_unused_parameters=True,
        gradient_as_bucket_view=grad_view,
        bucket_cap_mb=5000 / MB,
        first_bucket_cap_mb=1000 / MB,
    )
    theirs = TorchDDP(copy.deepcopy(reference), find_unused_parameters=True, gradient_as_bucket_view=grad_view)
    models = (ours, theirs, reference)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in models]
    local = local_slice(rank, world_size)
    # the branch: unused everywhere, used on rank 0 only, unused everywhere again (after a step that used it)
    for step, used_on in enumerate([(), (0,), ()]):
        x, y = make_batch(step)
        for model in (ours, theirs):
            torch.nn.functional.mse_loss(model(x[local], use_unused=rank in used_on), y[local]).backward()
        for r in range(world_size):  # one process, global batch, each half as its rank computed it
            part = local_slice(r, world_size)
            loss = torch.nn.functional.mse_loss(reference(x[part], use_unused=r in used_on), y[part])
            (loss / world_size).backward()
        named = zip(ours.module.named_parameters(), theirs.module.parameters(), reference.parameters(), strict=True)
        for (name, p_ours), p_torch, p_ref in named:
            if not p_ours.requires_grad:
                continue
            if p_torch.grad is None:
                assert p_ours.grad is None and p_ref.grad is None, f"step {step}: {name} has a gradient"
                assert not used_on and name.startswith("unused.")  # the premise: torch leaves exactly these None
                continue
            assert_close(p_ours.grad, p_torch.grad, rtol=0, atol=0, msg=f"step {step}: {name}")
            assert_close(p_ours.grad, p_ref.grad, rtol=1e-6, atol=1e-7, msg=f"step {step}: {name}")
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        for (name, p_ours), p_torch, p_ref in zip(
            ours.module.named_parameters(), theirs.module.parameters(), reference.parameters(), strict=True
        ):
            assert_close(p_ours, p_torch, rtol=0, atol=0, msg=f"step {step}: {name}")
            assert_close(p_ours, p_ref, rtol=1e-6, atol=1e-6, msg=f"step {step}: {name}")


@pytest.mark.parametrize("grad_view", [True, False], ids=["grad_as_bucket_view", "grad_copies"])
def test_unused_parameter_skipped_by_adamw_as_torch(grad_view):
    """find_unused_parameters=True: a parameter no rank used (and that accumulated nothing under no_sync) keeps
    grad=None, so AdamW with weight decay skips it; one used on some rank gets the average. Gradients equal torch
    DDP's (None where torch's are None) and the global batch's, and so do parameters after each AdamW step."""
    run_distributed(_globally_unused_under_adamw, grad_view)


def _mismatch(rank, world_size, kind):
    torch.manual_seed(0)
    model = Net(hidden=32 if rank == 0 or kind != "shape" else 48)
    if kind == "extra_trainable" and rank == 1:
        model.frozen.requires_grad_(True)
    if kind == "frozen_weights" and rank == 1:
        with torch.no_grad():
            model.frozen.weight.add_(1.0)
    if kind == "swapped_rows" and rank == 1:  # same bytes, other order: a sum of bytes cannot tell
        with torch.no_grad():
            model.frozen.weight[[0, 1]] = model.frozen.weight[[1, 0]].clone()
    cap = 1e-9 if kind == "bucket_cap" and rank == 1 else 25.0
    try:
        BucketedDDP(model, bucket_cap_mb=cap, first_bucket_cap_mb=cap)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("shape", "'embed.weight'"),
        ("extra_trainable", "'frozen.weight'"),
        ("frozen_weights", "'frozen.weight'"),
        ("swapped_rows", "'frozen.weight'"),
        ("bucket_cap", "bucket 0"),
    ],
)
def test_mismatched_models_raise_naming_the_difference(kind, expected):
    messages = run_distributed(_mismatch, kind, timeout=60)
    for message in messages:
        assert message is not None and expected in message, message


def _state_dict_and_errors(rank, world_size):
    torch.manual_seed(0)
    inner = Net()
    model = BucketedDDP(inner)
    assert model.module is inner
    keys = list(model.state_dict())
    assert keys == list(inner.state_dict()) and not any(k.startswith("module.") for k in keys)
    saved = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(saved)
    for k, v in inner.state_dict().items():
        assert torch.equal(v, saved[k])
    with pytest.raises(RuntimeError, match="only be called once"):
        model.register_comm_hook(None, torch_hooks.allreduce_hook)
        model.register_comm_hook(None, torch_hooks.allreduce_hook)
    # a backward through .module skips the wrapper: a clear error, not a silent unsynced step
    model2 = BucketedDDP(Net())
    x, y = make_batch(0)
    with pytest.raises(RuntimeError, match="did not follow a forward through the wrapper"):
        torch.nn.functional.mse_loss(model2.module(x), y).backward()


def test_state_dict_unprefixed_and_misuse_reported():
    run_distributed(_state_dict_and_errors)


def _start_from_rank0(rank, world_size):
    torch.manual_seed(0)  # same frozen weights; trainable weights and the buffer made to differ by rank
    model = Net()
    with torch.no_grad():
        model.embed.weight.add_(rank)
        model.scale.fill_(float(rank + 1))
    ddp = BucketedDDP(model)
    assert_same_on_all_ranks([p for p in model.parameters() if p.requires_grad] + [model.scale])
    assert model.scale[0].item() == 1.0
    model.scale.fill_(float(rank + 5))
    ddp(torch.zeros(2, 16))  # a synced forward re-broadcasts buffers from rank 0
    assert model.scale[0].item() == 5.0
    assert dist.get_world_size() == world_size


def test_parameters_and_buffers_start_from_rank_0():
    run_distributed(_start_from_rank0)


class _SharedAcrossCheckpoints(torch.nn.Module):
    """One layer applied in two reentrant checkpointed segments: its gradient arrives in two pieces."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.shared, x, use_reentrant=True)
        h = checkpoint(self.shared, torch.tanh(h), use_reentrant=True)
        return self.head(h)


def _gradient_in_two_pieces(rank, world_size):
    torch.manual_seed(0)
    model = BucketedDDP(_SharedAcrossCheckpoints(), bucket_cap_mb=1e-9, first_bucket_cap_mb=1e-9)
    x, y = make_batch(0)
    local = local_slice(rank, world_size)
    with pytest.raises(RuntimeError, match="twice in one backward") as error:
        torch.nn.functional.mse_loss(model(x[local].requires_grad_()), y[local]).backward()
    assert "use_reentrant" in str(error.value) and "'shared." in str(error.value)


def test_reentrant_gradient_arriving_twice_raises():
    run_distributed(_gradient_in_two_pieces)


def _loss_scaled_in_place(rank, world_size):
    torch.manual_seed(0)
    reference = Net()
    ours = BucketedDDP(copy.deepcopy(reference))
    x, y = make_batch(0)
    local = local_slice(rank, world_size)
    out = ours(x[local])
    out *= 3.0  # the HF Trainer scales its loss in place: the wrapper must leave outputs untouched
    torch.nn.functional.mse_loss(out, 3.0 * y[local]).backward()
    torch.nn.functional.mse_loss(3.0 * reference(x), 3.0 * y).backward()
    for g_ours, g_ref in zip(_grads(ours.module), _grads(reference), strict=True):
        assert_close(g_ours, g_ref, rtol=1e-6, atol=1e-7)


def test_outputs_modified_in_place_still_reduce():
    run_distributed(_loss_scaled_in_place)
