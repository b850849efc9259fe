"""The forecast check (``python -m ddp_ft.tools.forecast_check``): its verdicts on hand-made numbers, its commands
on CUDA (2 processes sharing one GPU over gloo), and one quick real run of the whole command on the CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_ft.tools.forecast_check import (
    QUANTITIES,
    compare,
    judge,
    main,
    markdown,
    passed,
    run_medians,
)
from ddp_ft.tools.forecast_check import cli as check_cli
from ddp_ft.tools.forecast_check.stages import QUICK, doctor_command, environment, train_command
from ddp_ft.tools.gpu_report import summaries
from ddp_ft.tools.gpu_report.plan import plan_steps

ROOT = Path(__file__).resolve().parents[2]


def _records(step_times: list[float], exposed: list[float] | None, world_size: int = 2) -> list[dict]:
    trains = [
        {"type": "train", "step": i + 1, "step_time_s": t} | ({} if exposed is None else {"comm/exposed_comm_ms": e})
        for i, (t, e) in enumerate(zip(step_times, exposed or step_times, strict=True))
    ]
    return [{"type": "config", "run_name": "r", "world_size": world_size}, *trains]


def test_judge_says_inside_below_or_above_the_range():
    assert judge(0.5, [0.49, 0.52, 0.51])["verdict"] == "inside"
    assert judge(0.49, [0.49, 0.52])["inside"]  # the bounds count as inside
    assert judge(0.52, [0.49, 0.52])["inside"]
    assert judge(0.48, [0.49, 0.52]) | {"forecast": 0} == {
        "forecast": 0,
        "low": 0.49,
        "high": 0.52,
        "verdict": "below",
        "inside": False,
    }
    assert judge(0.53, [0.49, 0.52])["verdict"] == "above"
    with pytest.raises(ValueError, match="no measured run"):
        judge(0.5, [])


def test_run_medians_leave_out_the_first_step():
    # step 1 (9 s, 900 ms) is warm-up: the medians are of steps 2..5
    medians = run_medians(_records([9.0, 0.4, 0.5, 0.6, 0.7], [900.0, 1.0, 2.0, 3.0, 4.0]))
    assert medians == {
        "step_time_s": pytest.approx(0.55),
        "exposed_comm_ms": pytest.approx(2.5),
        "host_load_1m": None,
        "micro_step_ms": None,
    }


def test_micro_step_is_rank_0_forward_and_backward():
    # what the forecast assumes every rank computes at: forward + backward of steps 2..N, the warm-up left out
    records = _records([9.0, 0.4, 0.5, 0.6], [900.0, 1.0, 2.0, 3.0])
    for step, (forward, backward) in enumerate([(500.0, 900.0), (30.0, 60.0), (40.0, 70.0), (20.0, 50.0)], 1):
        records.append({"type": "backward", "step": step, "forward_ms": forward, "backward_ms": backward})
    records.append({"type": "backward", "step": 5, "backward_ms": 10.0})  # no forward time: not a micro-step
    assert run_medians(records)["micro_step_ms"] == pytest.approx(90.0)


def test_run_medians_of_one_process_have_no_exposed():
    medians = run_medians(_records([2.0, 1.0, 1.0], None, world_size=1))
    assert medians == {"step_time_s": 1.0, "exposed_comm_ms": None, "host_load_1m": None, "micro_step_ms": None}


def test_compare_judges_each_source_on_every_quantity():
    forecasts = {
        "single": {"step_time_s": 0.51, "exposed_comm_ms": 4.0},
        "pair0": {"step_time_s": 0.50, "exposed_comm_ms": 9.0},
    }
    runs = [{"step_time_s": t, "exposed_comm_ms": e} for t, e in ((0.513, 3.1), (0.515, 3.5), (0.523, 7.9))]
    result = compare(forecasts, runs)
    assert set(result) == set(QUANTITIES)
    step, exposed = result["step_time_s"], result["exposed_comm_ms"]
    assert step["verdict"] == "below" and step["runs"] == [0.513, 0.515, 0.523] and step["low"] == 0.513
    assert exposed["verdict"] == "inside" and exposed["forecast"] == 4.0 and exposed["high"] == 7.9
    assert exposed["by_source"]["pair0"]["verdict"] == "above"
    assert not passed(result)
    assert passed(compare({"single": forecasts["single"] | {"step_time_s": 0.52}}, runs))


def test_compare_refuses_runs_without_exposed_comm():
    with pytest.raises(ValueError, match="one process"):
        compare({"single": {"step_time_s": 1.0, "exposed_comm_ms": 1.0}}, [{"step_time_s": 1, "exposed_comm_ms": None}])


def test_markdown_shows_numbers_and_verdicts():
    forecasts = {s: {"step_time_s": 0.5, "exposed_comm_ms": 4.0} for s in ("single", "pair0", "pair1")}
    runs = [{"step_time_s": 0.498, "exposed_comm_ms": 1.8}, {"step_time_s": 0.5, "exposed_comm_ms": 8.1}]
    result = {
        "nproc": 2,
        "device": "cpu",
        "preset": "tiny",
        "steps": 16,
        "runs": runs,
        "single": {"step_time_s": 0.943, "host_load_1m": 0.5, "micro_step_ms": 97.04},
        "pair": [{"step_time_s": 0.99, "micro_step_ms": 95.0}, {"step_time_s": 1.0}],
        "link": {"bandwidth_gbps": 1.39, "latency_us": 170.0},
        "quantities": compare(forecasts, runs),
        "passed": True,
    }
    table = markdown(result)
    assert "| step time | **0.500 s** | 0.500 s, 0.500 s | 0.498 s, 0.500 s | **inside** [0.498 s, 0.500 s] |" in table
    assert "| exposed communication | **4.0 ms** |" in table and "Verdict: PASS" in table
    assert "medians of steps 2..16" in table and "1.39 GB/s" in table
    assert "one process 0.5; the pair ?, ?; the runs ?, ?" in table
    assert "as the one process did: one process 97.0 ms; the pair 95.0 ms, ?; the runs ?, ?." in table


def test_cuda_runs_train_and_doctor_over_gloo(tmp_path, monkeypatch):
    """``--device cuda`` runs: every command over gloo, on the one GPU the environment shows."""
    ran = []
    monkeypatch.setattr(check_cli, "run_check", lambda out, device, *rest: ran.append(device) or {"wall_s": 0.0})
    monkeypatch.setattr(check_cli, "markdown", lambda result: "")
    main(["--out", str(tmp_path / "out"), "--device", "cuda", "--quick"])
    assert ran == ["cuda"] and (tmp_path / "out" / "forecast_check.json").exists()
    pair = train_command(tmp_path / "ddp0", 3, "tiny", 2)
    assert pair[3:6] == ["train", "--nproc", "2"] and pair[pair.index("--backend") + 1] == "gloo"
    assert "--no-compile" in pair and pair[pair.index("--packing") + 1] == "false"  # eager and padded, as on the CPU
    probe = doctor_command(tmp_path / "probe", "cuda", QUICK, 2)
    assert probe[probe.index("--device") : probe.index("--device") + 4] == ["--device", "cuda", "--backend", "gloo"]
    assert environment("cuda", {"CUDA_VISIBLE_DEVICES": "3,5"})["CUDA_VISIBLE_DEVICES"] == "3"  # the ranks share it
    assert environment("cuda", {})["CUDA_VISIBLE_DEVICES"] == "0"
    assert environment("cpu", {"CUDA_VISIBLE_DEVICES": "3"})["CUDA_VISIBLE_DEVICES"] == ""


def test_gpu_report_plans_it_after_shared_gpu_gloo(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    skips = {}
    for device in ("cpu", "cuda"):
        steps = plan_steps(device, 1, tmp_path, ROOT / "scripts", "python")
        names = [s.name for s in steps]
        at = names.index("forecast_check")
        assert names[at - 1 : at + 2] == ["shared_gpu_gloo", "forecast_check", "gpu_check"]
        assert steps[at].command[-4:-2] == ["--device", "cuda"]
        skips[device] = steps[at].skip
    assert "make forecast-check" in skips["cpu"] and skips["cuda"] is None  # it ran skipped before gloo on CUDA
    assert steps[at].env == {"CUDA_VISIBLE_DEVICES": "2"}


def test_gpu_report_summary_gives_the_headline():
    forecasts = {"single": {"step_time_s": 0.5, "exposed_comm_ms": 4.0}}
    runs = [{"step_time_s": 0.498, "exposed_comm_ms": 1.8}, {"step_time_s": 0.5, "exposed_comm_ms": 8.1}]
    quantities = compare(forecasts, runs)
    result = {"passed": passed(quantities), "device": "cuda", "quantities": quantities, "runs": runs}
    summary, problems = summaries.forecast_check(result, {})
    assert summary["headline"] == (
        "PASS: step time 0.500 s inside [0.498, 0.500] s, exposed communication 4.0 ms inside [1.8, 8.1] ms "
        "(2 runs of 2 processes)"
    )
    assert summary["quantities"]["step_time_s"]["verdict"] == "inside" and problems == []


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_cpu_run_writes_every_verdict(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    command = [sys.executable, "-m", "ddp_ft.tools.forecast_check", "--out", str(tmp_path), "--quick"]
    (tmp_path / "single" / "latest").mkdir(parents=True)  # an earlier check's run: cleared, not resumed
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[5/5] ddp-ft forecast" in done.stdout
    result = json.loads((tmp_path / "forecast_check.json").read_text())
    assert set(result["quantities"]) == set(QUANTITIES) and isinstance(result["passed"], bool)
    for q in result["quantities"].values():
        assert q["verdict"] in ("inside", "below", "above") and len(q["runs"]) == 1
        assert q["forecast"] > 0 and set(q["by_source"]) == {"single", "pair0", "pair1"}
    assert "**" in (tmp_path / "forecast_check.md").read_text()
