"""``make gpu-report``: the orchestration with fake step commands (order, a failing step recorded
and the next still run, the time budget, timeouts, the report rewritten atomically after every step), the checks of a
variant against its baseline, the plan per host, and ``scripts/gpu_report.py --device cpu`` end to end."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_ft.tools.gpu_report import FAILED, Step, report_failed, run_report, summaries, write_report
from ddp_ft.tools.gpu_report.plan import plan_steps
from ddp_ft.tools.gpu_report.runner import choose_steps

from ..helpers.dist_harness import PYTHONPATH

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
HEADER = {"device": "cpu", "gpus": [], "versions": {"torch": "x", "cuda": None}}
E2E = ["loop_defaults", "recipe_defaults", "packed_2048", "pieces", "packed_2048_short", "packed_2048_short_sdpa"]
E2E += ["loop_old_defaults", "stock_reference", "loop_half_micro_batch"]
CELLS = {
    mb: [f"decomp_{c}_{k}_{mb}" for k in ("ckpt", "nockpt") for c in ("eager", "compiled")] for mb in ("auto", "mb1")
}
CPU_STEPS = [E2E[0], *CELLS["auto"], *E2E[1:], *CELLS["mb1"], "shared_gpu_gloo", "forecast_check", "gpu_check"]
CPU_STEPS += ["ladder", "scaling_2gpu"]
CPU_RUN = {"loop_defaults", "decomp_eager_nockpt_auto", "gpu_check", "ladder"}
CUDA_STEPS = ["random_model", *E2E[:6], *CELLS["auto"], *E2E[6:], *CELLS["mb1"], *CPU_STEPS[-5:]]


def writes(path: Path, payload: dict) -> list[str]:
    """A fake step command: write ``payload`` as JSON to ``path``."""
    return [PY, "-c", f"import json, sys; json.dump({payload!r}, open(sys.argv[1], 'w'))", str(path)]


def quiet(lines: list[str]):
    return lines.append


def test_steps_run_in_order_past_a_recorded_failure(tmp_path):
    out = tmp_path / "report.json"
    steps = [
        Step(
            "first",
            "writes",
            writes(tmp_path / "a.json", {"x": 1}),
            tmp_path / "a.json",
            summarize=lambda r, done: ({"headline": f"x={r['x']}"}, []),
        ),
        Step("broken", "exits 3", [PY, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"]),
        Step("no_cuda", "skipped when planned", [PY, "-c", "raise SystemExit(9)"], skip="needs CUDA"),
        Step("silent", "exits 0 without its JSON", [PY, "-c", "pass"], tmp_path / "never.json"),
        Step("last", "still runs", writes(tmp_path / "d.json", {"y": 2}), tmp_path / "d.json"),
    ]
    lines: list[str] = []
    report = run_report(steps, out, 600, HEADER, progress=quiet(lines))
    assert json.loads(out.read_text()) == report and report["finished"] and report["device"] == "cpu"
    assert [s["name"] for s in report["steps"]] == ["first", "broken", "no_cuda", "silent", "last"]
    first, broken, no_cuda, silent, last = report["steps"]
    assert (first["status"], first["exit_status"], first["result"]) == ("passed", 0, {"x": 1})
    assert first["summary"]["headline"] == "x=1" and first["seconds"] > 0 and "a.json" in first["command"]
    assert (broken["status"], broken["exit_status"], broken["reason"]) == ("failed", 3, "exit status 3")
    assert "boom" in broken["error_tail"] and "boom" in Path(broken["log"]).read_text()
    assert (no_cuda["status"], no_cuda["reason"], no_cuda["exit_status"]) == ("skipped", "needs CUDA", None)
    assert silent["status"] == "failed" and "wrote no" in silent["reason"]
    assert last["status"] == "passed" and last["result"] == {"y": 2}
    assert report_failed(report) and len(lines) == 9  # a line per start and end, one per skip
    assert not report_failed({"steps": [first, no_cuda, last]})


def test_step_over_budget_skipped_shorter_ones_run(tmp_path):
    now = [0.0]

    def slow(result, done):  # the first step "took" 95 s of the 100 s budget
        now[0] += 95
        return {}, []

    steps = [
        Step("long", "", writes(tmp_path / "a.json", {}), tmp_path / "a.json", expected_s=10, summarize=slow),
        Step("too_long", "", [PY, "-c", "pass"], expected_s=10),
        Step("short", "", [PY, "-c", "pass"], expected_s=2, timeout_s=60),
    ]
    report = run_report(steps, tmp_path / "r.json", 100, HEADER, clock=lambda: now[0], progress=quiet([]))
    long, too_long, short = report["steps"]
    assert long["status"] == "passed" and long["timeout_s"] == 100  # its 300 s cap, or the budget left
    assert (
        too_long["status"] == "skipped"
        and "would not fit: expects 10 s, 5 s of the 100 s budget" in (too_long["reason"])
    )
    assert short["status"] == "passed" and short["timeout_s"] == 5  # capped at what is left
    assert report["elapsed_s"] == 95 and not report_failed(report)


def test_step_past_its_limit_is_killed_as_timed_out(tmp_path):
    steps = [
        Step(
            "hangs",
            "",
            [PY, "-c", "import time; print('started', flush=True); time.sleep(60)"],
            expected_s=1,
            timeout_s=1,
        ),
        Step("after", "", [PY, "-c", "pass"]),
    ]
    started = time.monotonic()
    report = run_report(steps, tmp_path / "r.json", 600, HEADER, progress=quiet([]))
    assert time.monotonic() - started < 15
    hangs, after = report["steps"]
    assert hangs["status"] == "timeout" and "did not finish within 1 s" in hangs["reason"]
    assert "started" in hangs["error_tail"] and after["status"] == "passed" and report_failed(report)


def test_report_on_disk_after_each_step_names_running(tmp_path):
    out = tmp_path / "r.json"
    seen = tmp_path / "seen.json"
    peek = (
        "import json, sys; r = json.load(open(sys.argv[1])); "
        "json.dump([s['status'] for s in r['steps']], open(sys.argv[2], 'w'))"
    )
    steps = [
        Step("one", "", writes(tmp_path / "a.json", {"a": 1}), tmp_path / "a.json"),
        Step("two", "", [PY, "-c", peek, str(out), str(seen)]),
        Step("three", "", [PY, "-c", "pass"]),
    ]
    copies: list[dict] = []

    def snapshot(report: dict) -> None:  # a deep copy of what was just written
        copies.append(json.loads(json.dumps(report)))

    report = run_report(steps, out, 600, HEADER, progress=quiet([]), also_write=snapshot)
    assert json.loads(seen.read_text()) == ["passed", "running", "pending"]  # what the file held during step two
    assert [[s["status"] for s in c["steps"]] for c in copies] == [
        ["pending", "pending", "pending"],
        ["running", "pending", "pending"],
        ["passed", "pending", "pending"],
        ["passed", "running", "pending"],
        ["passed", "passed", "pending"],
        ["passed", "passed", "running"],
        ["passed", "passed", "passed"],
        ["passed", "passed", "passed"],  # finished
    ]
    assert report["finished"] and not copies[-2]["finished"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".r.json")) == []  # no temporary left


def test_failed_rewrite_leaves_previous_report_whole(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    write_report({"steps": ["kept"]}, out)

    def breaks(obj, f, **kw):
        f.write('{"steps": [')
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", breaks)
    with pytest.raises(OSError, match="disk full"):
        write_report({"steps": ["lost"]}, out)
    monkeypatch.undo()
    assert json.loads(out.read_text()) == {"steps": ["kept"]}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def _bench_result(losses: list[float], tokens: float, peak: float | None, dtype: str = "bfloat16") -> dict:
    mode = {"tokens_per_s": tokens, "step_s": 1.0, "mfu": None, "peak_allocated_gb": peak, "peak_reserved_gb": peak}
    return {
        "device": "x",
        "world_size": 1,
        "compute_dtype": dtype,
        "modes": {"bucketed_ddp": {**mode, "losses": losses}},
    }


def test_variant_passes_within_dtype_tolerance_only():
    baseline = {"status": "passed", "result": _bench_result([12.0, 11.9, 11.8], 600.0, 8.0)}
    close = _bench_result([12.01, 11.91, 11.79], 900.0, 6.0)  # bf16: within 2e-2 relative
    summary, problems = summaries.variant(close, {"variant_baseline": baseline})
    against = summary["against_baseline"]
    assert problems == [] and against["tokens_per_s_ratio"] == 1.5 and against["peak_allocated_ratio"] == 0.75
    assert against["losses_compared"] == 3 and against["loss_max_relative_difference"] == pytest.approx(0.01 / 11.8)
    fp32 = {"status": "passed", "result": _bench_result([12.0, 11.9, 11.7], 600.0, 8.0, "float32")}
    _, problems = summaries.variant(
        _bench_result([12.0, 11.9, 11.8], 600.0, 8.0, "float32"), {"variant_baseline": fp32}
    )
    assert len(problems) == 1 and "tolerance 0.0001 in float32" in problems[0]
    shorter = {"status": "passed", "result": _bench_result([12.0, 11.9], 600.0, 8.0)}
    _, problems = summaries.variant(close, {"variant_baseline": shorter})
    assert "not the same steps" in problems[0]
    summary, problems = summaries.variant(close, {"variant_baseline": {"status": "failed"}})
    assert problems == [] and "no baseline to compare with (its step: failed)" in summary["headline"]


def test_plan_skips_what_host_cannot_run_with_reason(tmp_path):
    cpu = plan_steps("cpu", 0, tmp_path, ROOT / "scripts", "python")  # the CPU's smoke test needs no data
    assert [s.name for s in cpu] == CPU_STEPS
    assert {s.name for s in cpu if not s.skip} == CPU_RUN
    assert all("--device" in s.command or "--preset" in s.command for s in cpu if not s.skip)
    one = {s.name: s for s in plan_steps("cuda", 1, tmp_path, ROOT / "scripts", "python", data=tmp_path / "none")}
    assert list(one) == CUDA_STEPS and one["ladder"].skip and one["scaling_2gpu"].skip
    assert all("needs" in one[name].skip and "AMI" in one[name].skip for name in ("random_model", *E2E))  # no data
    unnamed = {s.name: s for s in plan_steps("cuda", 1, tmp_path, ROOT / "scripts", "python")}
    assert all("needs --data" in unnamed[name].skip for name in ("random_model", *E2E))  # no folder given
    assert "--no-gradient-checkpointing" in one["decomp_eager_nockpt_mb1"].command
    assert "auto" not in one["decomp_eager_nockpt_mb1"].command and "auto" in one["decomp_eager_ckpt_auto"].command
    assert one["shared_gpu_gloo"].env.keys() == {"CUDA_VISIBLE_DEVICES"} and "gloo" in one["shared_gpu_gloo"].command
    two = {s.name: s for s in plan_steps("cuda", 2, tmp_path, ROOT / "scripts", "python")}
    assert two["ladder"].skip is None and two["scaling_2gpu"].skip is None
    assert "--nproc_per_node=2" in two["scaling_2gpu"].command
    # one H100 and the data: the defaults, packing's cost and the decomposition at auto fit the default 600 s
    first = [s for s in plan_steps("cuda", 1, tmp_path, ROOT / "scripts", "python", data=tmp_path)]
    valuable = {"random_model", *E2E[:5], *CELLS["auto"]}
    assert sum(s.expected_s for s in first if s.name in valuable) <= 600


def test_e2e_runs_log_recompile_reasons(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    plan = {s.name: s for s in plan_steps("cuda", 1, tmp_path, ROOT / "scripts", "python", data=tmp_path)}
    runs = [name for name in E2E if name != "pieces"]  # the training runs
    assert all(plan[name].env == {"TORCH_LOGS": "recompiles"} for name in runs) and not plan["pieces"].env
    monkeypatch.setenv("TORCH_LOGS", "graph_breaks")
    plan = {s.name: s for s in plan_steps("cuda", 1, tmp_path, ROOT / "scripts", "python", data=tmp_path)}
    assert plan["loop_defaults"].env == {"TORCH_LOGS": "graph_breaks,recompiles"}


def test_chosen_steps_run_with_what_they_read(tmp_path):
    (tmp_path / "qwen2-tokenizer").mkdir()
    (tmp_path / "ami").mkdir()
    (tmp_path / "ami" / "ami_abstractive.jsonl").touch()
    plan = plan_steps("cuda", 1, tmp_path, ROOT / "scripts", "python", data=tmp_path)
    chosen = choose_steps(plan, ["gpu_check", "packed_2048_short", "recipe_defaults"])
    assert sorted(s.name for s in chosen) == sorted(s.name for s in plan)  # the rest reported, skipped
    run = [s.name for s in chosen if s.skip is None]
    assert run == ["gpu_check", "random_model", "pieces", "packed_2048_short", "recipe_defaults"]  # in the order asked
    skips = {s.name: s.skip for s in chosen}
    unchosen = "not chosen (--steps gpu_check packed_2048_short recipe_defaults)"
    assert skips["loop_defaults"] == skips["decomp_eager_ckpt_auto"] == unchosen
    assert "needs 2 or more" in skips["ladder"]  # a plan's own reason stays
    assert choose_steps(plan, None) == plan
    with pytest.raises(ValueError, match="--steps recipe: no such step; choose from random_model loop_defaults"):
        choose_steps(plan, ["recipe"])


def test_e2e_step_flags_peak_off_10pc_or_recompiles(tmp_path):
    from ddp_ft.tools.gpu_report.e2e import e2e_summary, read_run

    rows = [{"type": "config", "micro_batch": 16, "accumulation": 1}]
    rows += [
        {"type": "train", "tokens_per_s": rate, "peak_mem_gb": 20.0, "expected_peak_gb": 19.0, "step_time_s": 9.0}
        | {"loss": 2.0, "compile/time_s": 14.0, "compile/graphs": 2, "tokens": 8000, "elapsed_s": elapsed}
        for rate, elapsed in ((900.0, 9.0), (20000.0, 9.5), (21000.0, 10.0), (19000.0, 10.5))
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = read_run(metrics)
    assert (result["tokens_per_s"], result["tokens_per_s_range"]) == (20000.0, [19000.0, 21000.0])  # step 1 left out
    assert result["wall_tokens_per_s"] == 16000.0  # 3 steps of 8,000 tokens in 1.5 s, the gaps between them included
    summary, problems = e2e_summary(result, {})
    assert (
        problems == []
        and "20,000 non-padding tokens/s, 16,000 by the wall clock" in summary["headline"]
        and "compile 14 s" in summary["headline"]
    )
    assert "MFU 44.2%" in e2e_summary({**result, "mfu": 0.442}, {})[0]["headline"]
    _, problems = e2e_summary({**result, "peak_allocated_gb": 22.0}, {})
    assert problems and "beyond" not in problems[0] and "116%" in problems[0]
    _, problems = e2e_summary({**result, "compile": {"time_s": 14.0, "graphs": 3, "recompiles": 1}}, {})
    assert problems == ["1 graph compiled after step 1; the step's log names why"]


# A fake training run: its run_config.yaml, and 3 steps appended to metrics.jsonl in the folder it is given.
FAKE_RUN = """import json, pathlib, sys
folder = pathlib.Path(sys.argv[1]); folder.mkdir(parents=True, exist_ok=True)
(folder / "run_config.yaml").write_text("model: {model_name_or_path: x, compute_dtype: float32}")
with open(folder / "metrics.jsonl", "a") as f:
    f.writelines(json.dumps({"type": "train", "tokens_per_s": 10.0 * i, "loss": 1.0}) + "\\n" for i in (1, 2, 3))
"""


def test_e2e_step_run_again_measures_only_itself(tmp_path):
    """A report run again (a rerun on a warm GPU host) reads the new run alone: its folder starts empty, so an
    earlier run's records are not mixed in (nor would an entry point find an earlier run there to refuse)."""
    from ddp_ft.tools.gpu_report.e2e import run_and_read

    folder, out = tmp_path / "loop_defaults", tmp_path / "loop_defaults.json"
    for _ in range(2):
        assert run_and_read([PY, "-c", FAKE_RUN, str(folder)], folder, out) == 0
    result = json.loads(out.read_text())
    assert (result["steps"], result["tokens_per_s"], result["losses"]) == (3, 25.0, [1.0, 1.0, 1.0])


@pytest.mark.distributed
@pytest.mark.slow
def test_runs_end_to_end_on_cpu_recording_every_step(tmp_path):
    out = tmp_path / "gpu_report.json"
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    command = [PY, str(ROOT / "scripts" / "gpu_report.py"), "--device", "cpu", "--out", str(out)]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    report = json.loads(out.read_text())
    failed = {s["name"]: (s["reason"], s["error_tail"]) for s in report["steps"] if s["status"] in FAILED}
    assert run.returncode == 0, (run.stdout[-3000:], failed)
    assert [s["name"] for s in report["steps"]] == CPU_STEPS and report["finished"]
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert {n for n, st in status.items() if st == "passed"} == CPU_RUN
    assert {n for n, st in status.items() if st == "skipped"} == set(CPU_STEPS) - CPU_RUN
    steps = {s["name"]: s for s in report["steps"]}
    for name in CPU_RUN:
        assert steps[name]["result"] and steps[name]["summary"]["headline"]
    loop = steps["loop_defaults"]["summary"]
    assert loop["steps"] == 2 and loop["tokens_per_s"] > 0 and loop["micro_batch"] == 2  # the tiny preset's
    for name in ("decomp_eager_nockpt_auto",):
        auto = steps[name]["summary"]["micro_batch_auto"]
        assert (auto["micro_batch"], auto["accumulation"]) == (4, 1) and auto["expected_peak_gb"] > 0
        assert auto["measured_peak_allocated_gb"] is None  # no CUDA allocator on the CPU
        # the probe on the model as built (the profiler's memory events), the arithmetic's first guess beside it
        assert [m for m, _ in auto["probe"]["points"]] == [1, 2, 4] and auto["arithmetic"]["micro_batch"] == 4
        assert auto["expected_peak_gb"] == auto["probe"]["expected_peak_gb"]
    assert steps["decomp_eager_nockpt_auto"]["result"]["kernels"]["gradient_checkpointing"] is False
    assert steps["gpu_check"]["summary"]["passed"] and steps["gpu_check"]["summary"]["backend"] == "gloo"
    markdown = out.with_suffix(".md").read_text()
    assert "# GPU report" in markdown and "the smoke test" in markdown
    assert f"| {len(CPU_STEPS)} | scaling_2gpu | skipped |" in markdown
    assert "scaling_2gpu | skipped" in run.stdout


def test_e2e_mfu_from_run_config_and_gpu(tmp_path):
    """MFU = tokens/s x the Qwen3's model FLOPs per token at the run's sequence and LoRA rank / the GPU's bf16 peak."""
    import yaml
    from transformers import Qwen3Config

    from ddp_ft.tools.bench import qlora_training_flops
    from ddp_ft.tools.gpu_report.e2e import run_mfu
    from ddp_ft.training.model.memory import Qwen3Shape

    model = tmp_path / "model"
    Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                num_key_value_heads=2, vocab_size=100).save_pretrained(model)  # fmt: skip
    config = {"model": {"model_name_or_path": str(model), "compute_dtype": "auto"}, "data": {"max_seq_len": 512}}
    (tmp_path / "run_config.yaml").write_text(yaml.safe_dump(config | {"lora": {"lora_r": 8}}))
    flops = qlora_training_flops(Qwen3Shape.from_config(Qwen3Config.from_pretrained(model)), 512, 8)
    assert run_mfu(tmp_path, 1e6, "NVIDIA H200") == pytest.approx(1e6 * flops.per_token / 989e12)
    assert run_mfu(tmp_path, 1e6, "NVIDIA GeForce GTX 1080") is None  # no known peak
    config["model"]["compute_dtype"] = "float32"
    (tmp_path / "run_config.yaml").write_text(yaml.safe_dump(config | {"lora": {"lora_r": 8}}))
    assert run_mfu(tmp_path, 1e6, "NVIDIA H200") is None  # the peak is bf16's
