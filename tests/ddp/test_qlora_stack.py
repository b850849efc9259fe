"""BucketedDDP on the real QLoRA stack: tiny Qwen3 in 4-bit NF4 + LoRA + gradient checkpointing, 2 gloo ranks."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.testing import assert_close

from ddp_ft.ddp import BucketedDDP
from ddp_ft.training.model.qlora import LoraSettings, ModelSettings, build_tiny_qwen3, load_qlora_model

from ..helpers.dist_harness import gather_tensors, run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

VOCAB, SEQ, PER_RANK = 512, 48, 2


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return str(build_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "qwen3", vocab_size=VOCAB, seed=0))


# Tolerance against one process on the global batch (rtol, atol as a fraction of the largest gradient), which takes
# the DDP model's parameters before every step, so both compute the gradient at the same point. A matmul kernel may
# round a batch of 4 differently from a batch of 2: bf16 compute (the 4-bit matmuls; without autocast the residual
# stream and lm_head too, see ddp_ft.training.model.qlora._frozen_weights_kept) is held to bf16's precision, fp32 to
# fp32's. Measured on this CPU: within 9e-7 of the largest gradient in both dtypes and both layouts, at each of 3 steps.
GLOBAL_BATCH_TOL = {"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 1e-2)}


def _build(path, world_size, use_reentrant, compute_dtype="bfloat16"):
    torch.manual_seed(0)
    settings = ModelSettings(model_name_or_path=path, use_reentrant=use_reentrant, compute_dtype=compute_dtype)
    model = load_qlora_model(settings, LoraSettings(lora_dropout=0.0), {"": "cpu"}, world_size)
    with torch.no_grad():  # LoRA B starts at zero, which would leave every lora_A gradient zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.train()
    return model


def _batch(step, world_size):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (PER_RANK * world_size, SEQ), generator=g)


def _trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _trainable_grads(model):
    return [(n, p.grad.clone()) for n, p in _trainable(model)]


def _qlora_against_references(rank, world_size, path, compute_dtype, steps=2):
    reference, ours, theirs = (_build(path, world_size, False, compute_dtype) for _ in range(3))
    ours = BucketedDDP(ours, bucket_cap_mb=0.05, first_bucket_cap_mb=0.01)
    theirs = TorchDDP(theirs, bucket_cap_mb=0.05)
    rtol, atol_fraction = GLOBAL_BATCH_TOL[compute_dtype]
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for m in (ours, theirs)]
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for step in range(steps):
        ids = _batch(step, world_size)
        for model in (ours, theirs):
            model(input_ids=ids[local], labels=ids[local]).loss.backward()
        # The reference does not train on its own: AdamW's first update (about lr * sign(g)) turns 1e-6 differences
        # in near-zero gradients into lr-sized parameter differences, and the next step would compare two models.
        with torch.no_grad():
            for (_, p_ref), (_, p_ours) in zip(_trainable(reference), _trainable(ours.module), strict=True):
                p_ref.copy_(p_ours)
        reference(input_ids=ids, labels=ids).loss.backward()  # one process on the global batch
        assert ours.last_comm_stats().allreduce_calls == len(ours.bucket_sizes) > 1
        for (name, g_ours), (_, g_torch), (_, g_ref) in zip(
            _trainable_grads(ours.module), _trainable_grads(theirs.module), _trainable_grads(reference), strict=True
        ):
            assert torch.count_nonzero(g_ours) > 0, name
            assert_close(g_ours, g_torch, rtol=0, atol=0, msg=lambda m, n=name: f"vs torch DDP, {n}: {m}")
            assert_close(
                g_ours,
                g_ref,
                rtol=rtol,
                atol=atol_fraction * g_ref.abs().max().item(),
                msg=lambda m, n=name: f"vs global batch, {n}: {m}",
            )
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        params = [p for p in ours.module.parameters() if p.requires_grad]
        copies = gather_tensors(params)
        assert all(torch.equal(a, b) for a, b in zip(copies[0], copies[1], strict=True))
    return len(ours.bucket_sizes)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_non_reentrant_grads_equal_torch_and_global(tiny_qwen3, compute_dtype):
    assert run_distributed(_qlora_against_references, tiny_qwen3, compute_dtype, timeout=300)[0] > 1


def _reentrant(rank, world_size, path):
    reference = _build(path, world_size, True, "float32")
    ours = BucketedDDP(_build(path, world_size, True, "float32"), bucket_cap_mb=0.05, first_bucket_cap_mb=0.01)
    rtol, atol_fraction = GLOBAL_BATCH_TOL["float32"]
    ids = _batch(0, world_size)
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    ours(input_ids=ids[local], labels=ids[local]).loss.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    assert ours.last_comm_stats().allreduce_calls == len(ours.bucket_sizes) > 1
    for (name, g_ours), (_, g_ref) in zip(_trainable_grads(ours.module), _trainable_grads(reference), strict=True):
        assert torch.count_nonzero(g_ours) > 0, name
        assert_close(g_ours, g_ref, rtol=rtol, atol=atol_fraction * g_ref.abs().max().item(), msg=name)


def test_reentrant_checkpointing_gives_global_grads(tiny_qwen3):
    """Each decoder layer is one reentrant segment whose parameters are used once, so every gradient arrives once
    and the finalizer (queued in the outermost backward) averages them all: the global batch's gradients, no error.
    (A parameter reused across reentrant segments is the other case: an error, never a double count; see
    test_wrapper.py's test_reentrant_gradient_arriving_twice_raises.)"""
    run_distributed(_reentrant, tiny_qwen3, timeout=300)


def _quant_state_tensors(weight) -> dict[str, torch.Tensor]:
    """Every tensor of a 4-bit weight's quant state (NF4 with double quant): what a rank's base may differ in."""
    state = weight.quant_state
    assert state.state2 is not None, "the premise: double quant, so there is a nested state"
    return {
        "absmax": state.absmax,  # the per-block scales, themselves quantized by the nested state
        "code": state.code,  # the NF4 code book
        "nested_absmax": state.state2.absmax,
        "nested_code": state.state2.code,
    }


def _perturbed_quant_state(rank, world_size, path, what):
    """Rank 1's first 4-bit weight perturbed in one place at a time; each wrap's error (None: accepted)."""
    model = _build(path, world_size, False, "float32")
    name, weight = next((n, p) for n, p in model.named_parameters() if getattr(p, "quant_state", None) is not None)
    if what == "swapped_rows":  # two packed rows swapped: same bytes, another order
        assert not torch.equal(weight.data[0], weight.data[1])
        perturbations = {what: weight.data}
    else:
        perturbations = _quant_state_tensors(weight)
    errors = {}
    for part, tensor in perturbations.items():
        original = tensor.clone()
        if rank == 1:
            with torch.no_grad():
                if part == "swapped_rows":
                    tensor[[0, 1]] = tensor[[1, 0]].clone()
                else:
                    tensor[0] += 1  # a uint8 absmax wraps; a float one or a code book moves by 1
        try:
            BucketedDDP(model)
            errors[part] = None
        except RuntimeError as error:
            errors[part] = str(error)
        with torch.no_grad():
            tensor.copy_(original)
    return name, errors


@pytest.mark.parametrize("what", ["quant_state", "swapped_rows"])
def test_differing_4bit_base_raises_naming_the_weight(tiny_qwen3, what):
    """The frozen 4-bit base is not broadcast: a rank whose NF4 weight differs in any tensor of its quant state (not
    a parameter or buffer: the top-level ``absmax``, the code book, the nested double-quant ``absmax`` and code book,
    each in turn) or has two packed rows swapped must be refused at construction, naming the weight."""
    for name, errors in run_distributed(_perturbed_quant_state, tiny_qwen3, what, timeout=300):
        expected = ["absmax", "code", "nested_absmax", "nested_code"] if what == "quant_state" else [what]
        assert list(errors) == expected
        for part, message in errors.items():
            assert message is not None and f"{name!r}" in message, (part, name, message)


def _user_loop_steps(rank, world_size, path):
    """A user's 4-bit model, loaded without ddp_ft, in BucketedDDP: 3 SGD steps, without and with an evaluation
    (eval mode, no gradients) after each; every step's loss and gradient norm."""
    from ..helpers.trainers import user_qlora_model

    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    runs = []
    for evaluate in (False, True):
        model = BucketedDDP(user_qlora_model(path))
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trained, lr=0.1)
        steps = []
        for step in range(3):
            ids = _batch(step, world_size)[local]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            steps.append((loss.item(), torch.nn.utils.get_total_norm([p.grad for p in trained]).item()))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if evaluate:
                model.eval()
                with torch.no_grad():
                    model(input_ids=ids)
                model.train()
        runs.append(steps)
    return runs


def test_user_loop_eval_leaves_4bit_training_alone(tiny_qwen3):
    """Evaluating between steps leaves a user's 4-bit training as it was: BucketedDDP keeps bitsandbytes from
    repacking the weights for CPU inference (on CPUs with AVX-512 bf16), which made training's gradients wrong."""
    for plain, evaluated in run_distributed(_user_loop_steps, tiny_qwen3, timeout=240):
        assert_close(torch.tensor(evaluated), torch.tensor(plain), rtol=1e-6, atol=0.0)
