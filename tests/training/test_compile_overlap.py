"""Compilation keeps BucketedDDP's overlap, on the plain loop and on a user's Trainer script alike: each decoder layer
is compiled in place before the wrap, so all-reduces launch while backward still has layers to run, and the losses
equal the eager run's. The whole wrapped model is never compiled.

The probe (:class:`OverlapProbe`) counts, per backward, the compiled backward nodes that finish after the first
all-reduce launch: with one node per layer, the layers backward still had to run when communication began. A whole
compiled model has one node, done before any gradient is ready: none left.
"""

from __future__ import annotations

import json
import tempfile

import pytest
import torch
from torch.testing import assert_close

from ddp_ft.ddp import BucketedDDP, DDPSettings
from ddp_ft.ddp.comm_hooks import allreduce_hook
from ddp_ft.training.model.compilation import is_regionally_compiled, repeated_blocks

from ..helpers.dist_harness import run_distributed
from ..helpers.trainers import as_accelerate_rank, collate_tokens, gloo_trainer_args, token_rows, user_qlora_model

SMALL_BUCKETS = DDPSettings(bucket_cap_mb=0.02, first_bucket_cap_mb=0.02)  # about a layer's LoRA per bucket


class OverlapProbe:
    """Ordered events of one process: forward passes, compiled backward nodes done, bucket launches.

    Observes from outside the compiled code only (hooks inside it would break its graphs): after each forward of the
    wrapper, a hook on every ``CompiledFunctionBackward`` node of the loss's autograd graph; a comm hook on each
    bucket launch. Regional compilation gives one such node per decoder layer; a whole compiled model, one node.
    """

    def __init__(self) -> None:
        self.events: list[str] = []

    def attach(self, wrapped: BucketedDDP) -> None:
        def launch(state, bucket):
            self.events.append("launch")
            return allreduce_hook(state, bucket)

        wrapped.register_comm_hook(None, launch)
        wrapped.register_forward_hook(self._after_forward)

    def _after_forward(self, module, args, output) -> None:
        self.events.append("forward")
        loss = output["loss"] if isinstance(output, dict) else output.loss
        seen, todo = set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if "CompiledFunction" in node.name():
                node.register_hook(lambda grad_inputs, grad_outputs: self.events.append("node"))
            todo.extend(next_node for next_node, _ in node.next_functions)

    def nodes_left_at_first_launch(self) -> list[tuple[int, int]]:
        """Per synced backward: (compiled nodes done after its first all-reduce launch, compiled nodes in all)."""
        passes = []
        for event in self.events:
            if event == "forward":
                passes.append({"nodes": 0, "after": 0, "launched": False})
            elif event == "node":
                passes[-1]["nodes"] += 1
                passes[-1]["after"] += passes[-1]["launched"]
            else:
                passes[-1]["launched"] = True
        return [(p["after"], p["nodes"]) for p in passes if p["launched"]]


# ---------------------------------------------------------------- a user's BucketedTrainer script


class _ProbeCallback:
    """Attaches the probe once the Trainer has prepared (and compiled) the model, before the first step."""

    def __init__(self, probe: OverlapProbe, trainer) -> None:
        self.probe, self.trainer, self.attached = probe, trainer, False

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.attached:
            self.probe.attach(self.trainer.model_wrapped)
            self.attached = True


def _trainer_run(rank, world_size, compile: bool):
    as_accelerate_rank(rank, world_size)
    from transformers import TrainerCallback

    from ddp_ft.distributed import DistInfo
    from ddp_ft.integrations import BucketedTrainer
    from ddp_ft.training.model.qlora import EMBEDDED_MODEL
    from ddp_ft.training.setup import resolve_model_and_tokenizer

    model_dir, _ = resolve_model_and_tokenizer(EMBEDDED_MODEL, DistInfo())
    model = user_qlora_model(model_dir)
    probe = OverlapProbe()
    with tempfile.TemporaryDirectory() as out:
        args = gloo_trainer_args(
            out,
            max_steps=3,
            per_device_train_batch_size=2,
            learning_rate=1e-3,
            seed=0,
            torch_compile=compile,
            torch_compile_backend="aot_eager" if compile else None,  # AOTAutograd's one backward node per graph
        )
        trainer = BucketedTrainer(
            model=model, args=args, train_dataset=token_rows(), data_collator=collate_tokens, ddp_settings=SMALL_BUCKETS
        )
        callback = _ProbeCallback(probe, trainer)
        trainer.add_callback(type("Probe", (TrainerCallback,), {"on_step_begin": callback.on_step_begin})())
        trainer.train()
        metrics = [json.loads(line) for line in open(f"{out}/metrics.jsonl")] if rank == 0 else []
    wrapped = trainer.model_wrapped
    assert isinstance(wrapped, BucketedDDP), type(wrapped).__name__  # never a compiled module around the wrapper
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    compile_records = [
        {k: v for k, v in m.items() if k.startswith("compile/")} for m in metrics if m.get("type") == "train"
    ]
    layers = len(repeated_blocks(wrapped.module))
    return losses, probe.nodes_left_at_first_launch(), is_regionally_compiled(wrapped.module), layers, compile_records


@pytest.mark.distributed
@pytest.mark.slow
def test_trainer_compile_keeps_overlap_and_losses():
    """A user's BucketedTrainer script with TrainingArguments(torch_compile=True), 2 ranks: the decoder layers are
    compiled in place (not the wrapped model), every synced backward launches its first all-reduce with most layers
    still to run, as eager does, the losses equal the eager run's, and the compile counters reach metrics.jsonl."""
    eager = run_distributed(_trainer_run, False, timeout=300)
    compiled = run_distributed(_trainer_run, True, timeout=300)
    for rank in range(2):
        eager_losses, eager_left, eager_compiled, layers, _ = eager[rank]
        losses, left, regional, _, records = compiled[rank]
        assert len(left) == 3 and all(nodes == layers and after >= layers - 1 for after, nodes in left), (
            f"rank {rank}: (compiled backward nodes done after the first launch, in all) per step: {left}, of {layers}"
        )
        assert not eager_compiled and regional and all(nodes == 0 for _, nodes in eager_left), (regional, eager_left)
        assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=0.0)
    records = compiled[0][4]
    assert len(records) == 3 and records[-1]["compile/graphs"] >= 1, records
    assert records[-1]["compile/recompiles"] <= 1 and records[-1]["compile/limit_hits"] == 0, records


# ---------------------------------------------------------------- the plain loop


def _loop_runs(rank, world_size, root):
    """The plain loop on the tiny preset, eager then --compile, on this rank: layers left at each first launch."""
    from ddp_ft.distributed import DistInfo
    from ddp_ft.training import loop
    from ddp_ft.training.config import settings_from_preset

    probes, wrap = [], DDPSettings.wrap

    def wrap_with_probe(self, model):
        wrapped, probe = wrap(self, model), OverlapProbe()
        probe.attach(wrapped)
        probes.append((probe, len(repeated_blocks(model))))
        return wrapped

    DDPSettings.wrap = wrap_with_probe  # in this rank's process only (the harness forks one per test)
    info = DistInfo(rank, rank, world_size, world_size, torch.device("cpu"), "gloo")
    for compile in (False, True):
        settings = settings_from_preset(
            "tiny",
            compile=compile,
            output_dir=f"{root}/compile-{compile}",
            max_steps=STEPS,
            lora_dropout=0.0,  # the ranks' dropout masks aside, the two runs are the same computation
            report_to="none",
            bucket_cap_mb=0.02,
            first_bucket_cap_mb=0.02,
        )
        loop.train(settings, info)
    return [(probe.nodes_left_at_first_launch(), layers) for probe, layers in probes]


STEPS = 3


@pytest.mark.distributed
@pytest.mark.slow
def test_loop_compile_keeps_overlap_and_losses(tmp_path):
    """The plain loop with --compile (TorchInductor), 2 gloo ranks, BucketedDDP: in every synced backward the first
    all-reduce launches with most decoder layers' backward still to run, as in the eager run; each step's loss and
    gradient norm equal the eager run's to 1e-5 relative, and so does the final evaluation (no-grad passes run the
    layers eagerly: compiled, bitsandbytes' no-grad 4-bit path crashed on the CPU); metrics.jsonl counts the graphs,
    with no limit hit."""
    for rank, (eager, (left, layers)) in enumerate(run_distributed(_loop_runs, str(tmp_path), timeout=420)):
        assert all(nodes == 0 for _, nodes in eager[0]), eager
        assert len(left) == STEPS and all(nodes == layers and after >= layers - 1 for after, nodes in left), (
            f"rank {rank}: (compiled backward nodes done after the first launch, in all) per step: {left}, of {layers}"
        )

    def steps(compile, kind="train"):
        rows = [json.loads(line) for line in (tmp_path / f"compile-{compile}" / "metrics.jsonl").open()]
        return [row for row in rows if row.get("type") == kind]

    assert (tmp_path / "compile-True" / "run_config.yaml").read_text().count("compile: true") == 1
    eager, compiled = steps(False), steps(True)
    pairs = lambda rows: torch.tensor([(row["loss"], row["grad_norm"]) for row in rows])  # noqa: E731
    assert pairs(eager).shape == (STEPS, 2)
    assert_close(pairs(compiled), pairs(eager), rtol=1e-5, atol=0.0)
    assert all("compile/graphs" not in row for row in eager)
    evaluated = [[row["eval_loss"] for row in steps(compile, "eval")] for compile in (False, True)]
    assert len(evaluated[0]) == 1, evaluated
    assert_close(torch.tensor(evaluated[1]), torch.tensor(evaluated[0]), rtol=1e-5, atol=0.0)
    assert all(row["compile/graphs"] >= 1 and row["compile/limit_hits"] == 0 for row in compiled), compiled


# ---------------------------------------------------------------- TRL, Accelerate, the counters (one process)


def test_sft_trainer_compiles_layers_not_whole_model(tmp_path):
    """BucketedSFTTrainer with SFTConfig(torch_compile=True): the decoder layers compiled in place by the accelerator,
    the trained model never an OptimizedModule, and the compile counters in metrics.jsonl (one process)."""
    run_distributed(_sft_compiled, str(tmp_path), world_size=1, timeout=240)


def _sft_compiled(rank, world_size, out):
    from pathlib import Path

    as_accelerate_rank(rank, world_size)
    from ddp_ft.distributed import DistInfo
    from ddp_ft.integrations import BucketedSFTTrainer
    from ddp_ft.training.model.qlora import EMBEDDED_MODEL
    from ddp_ft.training.setup import resolve_model_and_tokenizer

    from ..helpers.trl_runs import Case, model_and_peft_config, rows, sft_config

    model_dir, tokenizer_dir = resolve_model_and_tokenizer(EMBEDDED_MODEL, DistInfo())
    case = Case("prompt_completion", False, "peft_config", False)
    model, lora = model_and_peft_config(model_dir, case, 1)
    args = sft_config(out, case, 1, max_steps=1, torch_compile=True, torch_compile_backend="aot_eager")
    from transformers import AutoTokenizer

    trainer = BucketedSFTTrainer(
        model=model,
        args=args,
        train_dataset=rows(case.data),
        peft_config=lora,
        processing_class=AutoTokenizer.from_pretrained(tokenizer_dir),
    )
    trainer.train()
    assert type(trainer.model_wrapped).__name__ != "OptimizedModule"
    assert is_regionally_compiled(trainer.model)
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").open()]
    assert [r["compile/graphs"] >= 1 for r in records if r.get("type") == "train"] == [True]


def test_dynamo_backend_compiles_layers_with_options():
    from accelerate.state import AcceleratorState
    from accelerate.utils import TorchDynamoPlugin
    from transformers import Qwen3ForCausalLM

    from ddp_ft.integrations import BucketedAccelerator
    from ddp_ft.training.model.qlora import tiny_qwen3_config

    AcceleratorState._reset_state(True)  # the state is shared: a plugin given to an earlier Accelerator would stay
    try:
        accelerator = BucketedAccelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", dynamic=False))
        model = Qwen3ForCausalLM(tiny_qwen3_config(64, num_hidden_layers=2))
        prepared = accelerator.prepare(model)
        assert prepared is model and is_regionally_compiled(model)  # one process: no wrapper, compiled in place
        compiled = repeated_blocks(model)[0].forward.compiled._torchdynamo_orig_callable  # the layer's own forward
        assert compiled.__self__ is repeated_blocks(model)[0]
        assert accelerator.state.dynamo_plugin.backend.value.lower() == "aot_eager"  # off for the prepare only
        assert accelerator.prepare(model) is model  # prepared again: compiled once
    finally:
        AcceleratorState._reset_state(True)


def test_watch_quiet_in_warm_up_warns_from_4_graphs(caplog):
    from ddp_ft.training.model.compilation import CompileWatch

    torch._dynamo.reset()
    watch = CompileWatch()
    square = torch.compile(lambda x: x * x, backend="eager", dynamic=False)
    cube = torch.compile(lambda x: x * x * x, backend="eager", dynamic=False)  # its own limit of 8
    try:
        with caplog.at_level("WARNING", logger="ddp_ft.training.model.compilation"):
            for size in range(2, 7):  # the warm-up: the probe's points, with and without checkpointing, step 1
                square(torch.ones(size))
            warm = watch.snapshot()
            quiet = [r.getMessage() for r in caplog.records]
            for size in range(2, 6):  # four more after it
                cube(torch.ones(size))
            snapshot = watch.snapshot()
    finally:
        watch.close()
        torch._dynamo.reset()
    assert warm["compile/graphs"] == 5 and warm["compile/recompiles"] == 0 and not quiet
    assert snapshot["compile/graphs"] == 9 and snapshot["compile/recompiles"] == 4
    assert snapshot["compile/time_s"] > 0 and snapshot["compile/limit_hits"] == 0
    warnings = [r.getMessage() for r in caplog.records if "recompile" in r.getMessage()]
    assert len(warnings) == 1 and "4 graphs compiled since warm-up" in warnings[0], warnings
    assert 'TORCH_LOGS="recompiles"' in warnings[0]


def test_graphs_of_several_functions_not_recompiles():
    """Two compiled functions, each compiled once in the first step (the layers and flex attention's mask builder),
    then called again with the same shapes: two graphs, no recompilation."""
    from ddp_ft.training.model.compilation import CompileWatch

    torch._dynamo.reset()
    watch = CompileWatch()
    square = torch.compile(lambda x: x * x, backend="eager")
    cube = torch.compile(lambda x: x * x * x, backend="eager")
    try:
        snapshots = []
        for _ in range(2):
            square(torch.ones(3)), cube(torch.ones(3))
            snapshots.append(watch.snapshot())
    finally:
        watch.close()
        torch._dynamo.reset()
    assert [s["compile/graphs"] for s in snapshots] == [2, 2]
    assert [s["compile/recompiles"] for s in snapshots] == [0, 0], snapshots


def test_graphs_between_steps_are_not_recompiles():
    """Evaluation between steps compiles what training does not (transformers' own flex attention, the mask
    builder without gradients): those graphs are no recompilation. A graph in a training step after it is."""
    from ddp_ft.training.model.compilation import CompileWatch

    torch._dynamo.reset()
    watch = CompileWatch()
    train = torch.compile(lambda x: x * x, backend="eager")
    evaluate = torch.compile(lambda x: x + 1, backend="eager", dynamic=False)
    try:
        train(torch.ones(3))
        first = watch.snapshot()
        watch.pause()
        for size in (3, 4, 5):  # the evaluation's first graphs and its new shapes
            evaluate(torch.ones(size))
        watch.resume()
        train(torch.ones(3))
        after_evaluation = watch.snapshot()
        train(torch.ones(2, 2))  # a new rank: a recompilation in training
        after_new_shape = watch.snapshot()
    finally:
        watch.close()
        torch._dynamo.reset()
    assert (first["compile/graphs"], first["compile/recompiles"]) == (1, 0)
    assert (after_evaluation["compile/graphs"], after_evaluation["compile/recompiles"]) == (4, 0)
    assert (after_new_shape["compile/graphs"], after_new_shape["compile/recompiles"]) == (5, 1)


def test_loop_evaluation_graphs_not_recompiles(tmp_path, monkeypatch):
    """The plain loop with --compile and an evaluation after every step, which compiles three graphs of its own:
    metrics.jsonl counts them as graphs, never as recompilations. Not 4-bit: on CPUs with AVX-512 bf16,
    bitsandbytes repacks 4-bit weights at the first evaluation, and the layers recompile for their new shape."""
    import functools

    import ddp_ft.training.loop as loop
    import ddp_ft.training.setup as setup
    from ddp_ft.distributed import DistInfo
    from ddp_ft.training.config import settings_from_preset

    evaluate = loop.evaluate
    extra = torch.compile(lambda x: x + 1, backend="eager", dynamic=False)

    def compiling_evaluate(*args, **kwargs):
        for size in (2, 3, 4):
            extra(torch.ones(size))
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(
        setup, "compile_repeated_blocks", functools.partial(setup.compile_repeated_blocks, backend="eager")
    )
    monkeypatch.setattr(loop, "evaluate", compiling_evaluate)
    monkeypatch.setenv("DDP_FT_CACHE", str(tmp_path / "cache"))
    torch._dynamo.reset()
    try:
        settings = settings_from_preset(
            "tiny",
            output_dir=str(tmp_path / "run"),
            compile=True,
            load_in_4bit=False,
            eval_every=1,
            max_steps=3,
            report_to="none",
        )
        loop.train(settings, DistInfo())
    finally:
        torch._dynamo.reset()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [row for row in rows if row.get("type") == "train"]
    assert [row["compile/recompiles"] for row in steps] == [0, 0, 0], steps
    assert steps[-1]["compile/graphs"] > steps[0]["compile/graphs"]  # the evaluations' graphs, counted


def _trainer_evaluating(rank, world_size, out):
    as_accelerate_rank(rank, world_size)
    from transformers import Qwen3ForCausalLM, TrainerCallback

    from ddp_ft.integrations import BucketedTrainer
    from ddp_ft.training.model.qlora import tiny_qwen3_config

    extra = torch.compile(lambda x: x + 1, backend="eager", dynamic=False)

    class CompilingEvaluation(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            for size in (2, 3, 4):
                extra(torch.ones(size))

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_qwen3_config(64, num_hidden_layers=2))
    args = gloo_trainer_args(out, max_steps=3, per_device_train_batch_size=2, eval_strategy="steps", eval_steps=1)
    args.torch_compile, args.torch_compile_backend = True, "aot_eager"
    trainer = BucketedTrainer(
        model=model, args=args, train_dataset=token_rows(), eval_dataset=token_rows(4), data_collator=collate_tokens
    )
    trainer.add_callback(CompilingEvaluation())
    trainer.train()
    rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    return [row for row in rows if row.get("type") == "train"]


def test_trainer_evaluation_graphs_not_recompiles(tmp_path):
    """A BucketedTrainer with torch_compile=True, evaluating after every step, where a callback compiles three
    graphs: metrics.jsonl counts them as graphs, never as recompilations (one process)."""
    (steps,) = run_distributed(_trainer_evaluating, str(tmp_path), world_size=1, timeout=240)
    assert [row["compile/recompiles"] for row in steps] == [0, 0, 0], steps
    assert steps[-1]["compile/graphs"] > steps[0]["compile/graphs"]  # the evaluations' graphs, counted
