"""The compute dtype a run picks: one pure choice from the setting, the device type and the GPU's
compute capability, checked on CPU without a GPU (torch.cuda's capability query monkeypatched where it is asked)."""

import pytest
import torch

from ddp_ft.training.model.precision import choose_precision
from ddp_ft.training.model.qlora import ModelSettings

from ..helpers.faults import injected


@pytest.mark.parametrize(
    ("requested", "device_type", "capability", "dtype", "loss_scaling"),
    [
        ("auto", "cuda", (9, 0), torch.bfloat16, False),  # H100
        ("auto", "cuda", (8, 0), torch.bfloat16, False),  # A100: the first with native bf16
        ("auto", "cuda", (7, 5), torch.float16, True),  # T4: bf16 is only emulated
        ("auto", "cuda", (7, 0), torch.float16, True),  # V100
        ("auto", "cpu", None, torch.float32, False),
        ("float16", "cuda", (9, 0), torch.float16, True),
        ("float16", "cpu", None, torch.float16, True),
        ("float32", "cuda", (7, 5), torch.float32, False),
        ("bfloat16", "cpu", None, torch.bfloat16, False),
    ],
)
def test_auto_picks_bf16_only_from_capability_8(requested, device_type, capability, dtype, loss_scaling):
    chosen = choose_precision(requested, device_type, capability)
    assert (chosen.dtype, chosen.loss_scaling, chosen.autocast) == (dtype, loss_scaling, dtype != torch.float32)
    if device_type == "cpu":  # a CUDA scaler disables itself without CUDA
        assert chosen.grad_scaler().is_enabled() == loss_scaling


@pytest.mark.parametrize("capability", [(7, 5), (7, 0), (6, 1)])
def test_bf16_on_an_emulating_card_is_refused(capability):
    with pytest.raises(ValueError, match=r"--compute-dtype bfloat16 .* capability .*--compute-dtype float16"):
        choose_precision("bfloat16", "cuda", capability)


def test_model_settings_ask_the_device_s_capability(monkeypatch):
    """``ModelSettings.precision`` asks the real device (a T4 here, mocked): it used to pick bf16 whenever CUDA
    existed, because ``torch.cuda.is_bf16_supported()`` is True on a T4."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert ModelSettings().precision(torch.device("cuda", 0)).dtype == torch.float16
    assert ModelSettings().precision(torch.device("cpu")).dtype == torch.float32


def _fp16_steps_with_one_rank_overflowing(rank, world_size, steps=3, overflow_step=1):
    import copy

    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from torch.testing import assert_close

    from ddp_ft.ddp import BucketedDDP

    from ..helpers.models import Net, local_slice, make_batch

    torch.manual_seed(0)
    base = Net()
    runs = {}
    for name, wrap in (("ours", BucketedDDP), ("torch", TorchDDP)):
        model = wrap(copy.deepcopy(base))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        scales, before_overflow, after_overflow = [], None, None
        for step in range(steps):
            x, y = make_batch(step)
            part = local_slice(rank, world_size)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x[part]).float(), y[part])
            if step == overflow_step and rank == 1:
                loss = loss * float("inf")  # only rank 1's local gradient overflows
            if step == overflow_step:
                before_overflow = [p.detach().clone() for p in model.parameters()]
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if step == overflow_step:
                after_overflow = [p.detach().clone() for p in model.parameters()]
            scales.append(scaler.get_scale())
        assert_close(after_overflow, before_overflow, rtol=0, atol=0, msg=f"{name}: the overflowing step moved")
        runs[name] = (scales, [p.detach().clone() for p in model.parameters()])
    assert_close(runs["ours"][1], runs["torch"][1], rtol=0, atol=0)
    return runs["ours"][0], runs["ours"][1]


@pytest.mark.distributed
def test_fp16_overflow_on_one_rank_skips_on_all_as_ddp():
    """Loss scaling under BucketedDDP: the scaled gradients are averaged before ``unscale_``, so the inf of
    one rank reaches every rank; all skip the step and halve the scale together, weights equal to torch DDP's with the
    same scaler bit for bit and the same on both ranks."""
    from torch.testing import assert_close

    from ..helpers.dist_harness import run_distributed

    (scales0, params0), (scales1, params1) = run_distributed(_fp16_steps_with_one_rank_overflowing, world_size=2)
    assert scales0 == scales1 == [2.0**10, 2.0**9, 2.0**9]
    assert_close(params0, params1, rtol=0, atol=0)


def test_fp16_loop_skips_overflow_resumes_its_scale(tmp_path):
    """``--compute-dtype float16`` in the plain loop with the gradient overflowing at step 1: the step is logged as
    skipped with the scale halved and the schedule held back a step; the scale is checkpointed, so a run resumed from
    step 2 trains step 3 at the same scale and loss (before ``scaler.pt`` it restarted at 65536). That every rank
    skips together is the BucketedDDP test above."""
    import math

    from ddp_ft.distributed import DistInfo
    from ddp_ft.report.metrics import read_jsonl
    from ddp_ft.training import loop
    from ddp_ft.training.config import parse_settings

    flags = [
        "--preset",
        "tiny",
        "--compute-dtype",
        "float16",
        "--max-steps",
        "3",
        "--effective-batch",
        "2",
        "--micro-batch",
        "1",
        "--max-seq-len",
        "96",
        "--eval-fraction",
        "0",
        "--report-to",
        "none",
    ]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    with injected("overflow@1"):
        loop.train(parse_settings([*flags, "--save-every", "2", "--output-dir", str(full)]), DistInfo())
    steps = [r for r in read_jsonl(full / "metrics.jsonl") if r["type"] == "train"]
    assert [(r["skipped"], r["loss_scale"]) for r in steps] == [(1, 2.0**15), (0, 2.0**15), (0, 2.0**15)]
    assert math.isnan(steps[0]["grad_norm"]) and steps[1]["lr"] == steps[0]["lr"]  # the schedule waited a step

    resume = ["--output-dir", str(resumed), "--resume", str(full / "ddp_ft-checkpoint-2")]
    loop.train(parse_settings([*flags, *resume]), DistInfo())
    (step3,) = [r for r in read_jsonl(resumed / "metrics.jsonl") if r["type"] == "train"]
    assert (step3["step"], step3["loss_scale"], step3["skipped"]) == (3, 2.0**15, 0)
    assert step3["loss"] == steps[2]["loss"]


def _fp16_loop_on_two_ranks(rank, world_size, out):
    """The plain loop in float16 on this rank, rank 1's gradient overflowing in step 1's first (``no_sync``)
    micro-batch; returns this rank's adapter and loss scale at the final save."""
    from ddp_ft.distributed import DistInfo
    from ddp_ft.training import loop
    from ddp_ft.training.config import parse_settings
    from ddp_ft.training.hooks import install_run_hooks

    from ..helpers.faults import FaultInjector, parse_faults

    install_run_hooks(FaultInjector(parse_faults("overflow@1,rank=1"), rank, attempt=0))
    saved = {}
    save_checkpoint = loop.save_checkpoint

    def recording_save(output_dir, model, *args, scaler=None, **kwargs):  # every rank saves (the RNG gather)
        saved["adapter"] = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        saved["scale"] = scaler.get_scale()
        return save_checkpoint(output_dir, model, *args, scaler=scaler, **kwargs)

    loop.save_checkpoint = recording_save
    flags = ["--preset", "tiny", "--compute-dtype", "float16", "--max-steps", "3", "--effective-batch", "4"]
    flags += ["--micro-batch", "1", "--max-seq-len", "96", "--eval-fraction", "0", "--report-to", "none"]
    info = DistInfo(rank, rank, world_size, world_size, torch.device("cpu"), "gloo")
    loop.train(parse_settings([*flags, "--save-every", "0", "--output-dir", out]), info)
    return saved


@pytest.mark.distributed
@pytest.mark.faults
def test_fp16_loop_skips_one_rank_s_overflow_on_both(tmp_path):
    """The plain loop itself (``forward_backward_timed``, the scaler, the schedule) on 2 ranks, accumulation 2: rank
    1's gradient overflows under ``no_sync`` in step 1. The inf reaches rank 0 with the synced micro-step's all-reduce,
    so both skip step 1 and halve the scale; steps 2 and 3 train with finite losses at that scale, and the two ranks
    end with the same adapter and the same scale, bit for bit."""
    import math

    from torch.testing import assert_close

    from ddp_ft.report.metrics import read_jsonl

    from ..helpers.dist_harness import run_distributed

    ranks = run_distributed(_fp16_loop_on_two_ranks, str(tmp_path / "run"), timeout=180)
    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["type"] == "train"]
    assert [(r["skipped"], r["loss_scale"]) for r in steps] == [(1, 2.0**15), (0, 2.0**15), (0, 2.0**15)]
    assert math.isnan(steps[0]["grad_norm"]) and all(math.isfinite(r["loss"]) for r in steps[1:]), steps
    assert [r["scale"] for r in ranks] == [2.0**15, 2.0**15]
    assert_close(ranks[0]["adapter"], ranks[1]["adapter"], rtol=0, atol=0)
