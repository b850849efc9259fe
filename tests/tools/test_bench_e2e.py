"""scripts/bench_e2e.py's launches, table and loss check (the benchmark itself runs minutes; its numbers are in
docs/performance.md)."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddp_ft.tools.bench_e2e import cli, runs, summary, table

ROOT = Path(__file__).resolve().parents[2]
bench_e2e = SimpleNamespace(
    _command=runs.command,
    run_config=runs.run_config,
    step_parts=runs.step_parts,
    plan_ceiling=runs.plan_ceiling,
    pool=summary.pool,
    format_table=table.format_table,
    format_pool=table.format_pool,
    main=cli.main,
)


def test_pair_is_two_singles_ddp_one_two_rank_launch(tmp_path):
    pair = bench_e2e._command("pair-loop", tmp_path, "m.jsonl", 16)
    ddp = bench_e2e._command("ddp-loop", tmp_path, "m.jsonl", 16)
    assert len(pair) == 2 and len(ddp) == 1
    assert [c[1:2] for c in pair] == [[str(ROOT / "scripts/train.py")]] * 2
    assert ddp[0][1:3] == ["--standalone", "--nproc_per_node=2"]
    flags = ["--preset", "tiny", "--report-to", "none", "--max-steps", "16", "--save-every", "0", "--source", "m.jsonl"]
    assert all(c[-len(flags) - 2 : -2] == flags for c in [*pair, *ddp])  # then --output-dir DIR
    assert {c[-1] for c in pair} == {str(tmp_path / "alone0"), str(tmp_path / "alone1")}
    recipe_pair, (recipe_ddp,) = (
        bench_e2e._command("pair-recipe", tmp_path, None, 8),
        bench_e2e._command("ddp-recipe", tmp_path, None, 8),
    )
    assert all("single.yaml" in c[3] for c in recipe_pair) and "2cpu_gloo.yaml" in recipe_ddp[3]
    assert "--source" not in recipe_ddp


def test_table_gives_ddp_over_pair_and_no_wait_ratio():
    t = {"median": 100.0, "min": 90.0, "max": 110.0, "all": []}
    result = {
        "command": "python scripts/bench_e2e.py",
        "hardware": "cpu",
        "summary": {
            "mixed": {
                "pair-loop": {"tokens_per_s": t, "compute_ms_per_1k_tokens": 640.0, "wait_share": 0.0},
                "ddp-loop": {
                    "tokens_per_s": t,
                    "compute_ms_per_1k_tokens": 650.4,
                    "wait_share": 0.031,
                    "imbalance": 1.02,
                    "wait_for_slowest_ms": 3.0,
                },
                "ddp_over_pair_loop": {"median": 0.97, "min": 0.95, "max": 0.99, "all": []},
                "no_wait_ddp_over_pair_loop": {"median": 1.0, "min": 0.98, "max": 1.02, "all": []},
                "ddp_over_ceiling_loop": {"median": 0.999, "min": 0.978, "max": 1.02, "all": []},
                "plan_ceiling": 0.971,
            }
        },
    }
    table = bench_e2e.format_table(result)
    assert (
        "| mixed | ddp-loop | 100 (90..110) | 0.970 (0.950..0.990) | 650 | 3.1% | 1.000 (0.980..1.020) | 1.020 |"
        in table
    )
    assert "| mixed | pair-loop | 100 (90..110) |  | 640 | 0.0% |  |  |" in table
    assert "slowest rank): mixed 0.971\n" in table
    assert table.endswith("(what the code and the machine cost): mixed ddp-loop 0.999 (0.978..1.020)")


def test_baseline_runs_other_checkout_and_pairs_it(tmp_path):
    base = tmp_path / "base"
    (recipe,) = bench_e2e._command("ddp-recipe@base", tmp_path, None, 8, root=base)
    assert recipe[3] == str(base / "accelerate_configs/2cpu_gloo.yaml") and recipe[4] == str(
        base / "recipes/qwen_ami.py"
    )
    (loop,) = bench_e2e._command("ddp-loop@base", tmp_path, None, 8, root=base)
    assert loop[3] == str(base / "scripts/train.py")
    with pytest.raises(ValueError, match="baseline"):
        bench_e2e.run_config("ddp-loop@base", tmp_path, None, 8, baseline=None)

    t = {"median": 100.0, "min": 90.0, "max": 110.0, "all": []}
    old = {"median": 95.0, "min": 85.0, "max": 105.0, "all": []}
    result = {
        "command": "python scripts/bench_e2e.py --baseline /tmp/base",
        "hardware": "cpu",
        "baseline_commit": "abc123",
        "summary": {
            "mixed": {
                "pair-loop": {"tokens_per_s": t},
                "ddp-loop@base": {"tokens_per_s": old},
                "ddp-loop": {"tokens_per_s": t},
                "ddp_over_pair_loop": {"median": 0.97, "min": 0.95, "max": 0.99, "all": []},
                "ddp_over_pair_loop@base": {"median": 0.92, "min": 0.90, "max": 0.94, "all": []},
                "ddp_over_baseline_loop": {"median": 1.05, "min": 1.01, "max": 1.08, "all": []},
            }
        },
    }
    rows = [line for line in bench_e2e.format_table(result).splitlines() if line.startswith("| mixed")]
    assert [row.split(" | ")[1] for row in rows] == ["pair-loop", "ddp-loop", "ddp-loop@base"]
    assert "| 0.970 (0.950..0.990) |" in rows[1] and "| 0.920 (0.900..0.940) |" in rows[2]
    assert bench_e2e.format_table(result).endswith(
        "this checkout's DDP / the baseline's (abc123), paired per repeat: mixed ddp-loop 1.050 (1.010..1.080)"
    )


def test_bad_or_unused_baseline_refused_before_runs(tmp_path, monkeypatch, capsys):
    for baseline in (tmp_path, ROOT):
        monkeypatch.setattr("sys.argv", ["bench_e2e.py", "--baseline", str(baseline)])
        with pytest.raises(SystemExit):
            bench_e2e.main()
        assert "--baseline" in capsys.readouterr().err
    other = tmp_path / "other"
    (other / "scripts").mkdir(parents=True)
    (other / "scripts" / "train.py").write_text("")
    for extra in (["--configs", "pair-loop", "pair-recipe"], ["--plan-ceiling"]):  # the baseline would go unused
        monkeypatch.setattr("sys.argv", ["bench_e2e.py", "--baseline", str(other), *extra])
        with pytest.raises(SystemExit):
            bench_e2e.main()
        assert (
            "give --configs at least one of ddp-loop, ddp-recipe, ddp-recipe-strided, ddp-trl"
            in capsys.readouterr().err
        )


def _records(world_size: int, steps: list[tuple[float, float, float]], tokens: int = 2000) -> list[dict]:
    rows = [{"type": "config", "world_size": world_size}]
    for step, (slowest_ms, fastest_ms, step_s) in enumerate(steps, 1):
        rows.append(
            {
                "type": "train",
                "step": step,
                "tokens": tokens,
                "step_time_s": step_s,
                "compute_max_ms": slowest_ms,
                "compute_min_ms": fastest_ms,
            }
        )
    return rows


def test_step_parts_split_compute_and_mean_wait():
    # first step (warm-up) left out; then the slower rank computes 120 ms, the faster 80: they wait 20 ms on average
    parts = bench_e2e.step_parts(_records(2, [(900.0, 100.0, 1.0), (120.0, 80.0, 0.13), (120.0, 80.0, 0.13)]))
    assert parts["compute_ms_per_1k_tokens"] == pytest.approx(100.0)  # mean 100 ms for each rank's 1,000 tokens
    assert parts["wait_share"] == pytest.approx(0.020 / 0.13)
    assert parts["no_wait_tokens_per_s"] == pytest.approx(2000 / 0.11)
    alone = bench_e2e.step_parts(_records(1, [(50.0, 50.0, 0.06), (100.0, 100.0, 0.11)]))
    assert alone == pytest.approx(
        {"compute_ms_per_1k_tokens": 50.0, "wait_share": 0.0, "no_wait_tokens_per_s": 2000 / 0.11}
    )
    with pytest.raises(ValueError, match="world size 4"):
        bench_e2e.step_parts(_records(4, [(1.0, 1.0, 1.0)]))


def test_plan_ceiling_1_if_full_below_1_mixed_lengths(tmp_path):
    from ddp_ft.training.data.synthetic import write_mixed_length_meetings

    assert bench_e2e.plan_ceiling(None, 16, tmp_path / "tiny") == 1.0  # the tiny preset: every sample 256 tokens
    mixed = write_mixed_length_meetings(tmp_path / "mixed.jsonl", n=160)
    assert 0.9 < bench_e2e.plan_ceiling(str(mixed), 16, tmp_path / "mixed") < 1.0


def _run_json(max_steps: int, ratios: dict[str, dict[str, list[float]]], ceilings: dict[str, float]) -> dict:
    summary = {
        data: {f"ddp_over_pair_{entry}": {"all": values} for entry, values in by_entry.items()}
        for data, by_entry in ratios.items()
    }
    for data, ceiling in ceilings.items():
        summary[data]["plan_ceiling"] = ceiling
    return {"settings": {"max_steps": max_steps}, "summary": summary}


def test_pool_gives_every_repeat_and_count_at_target():
    first = _run_json(16, {"mixed": {"loop": [0.90, 0.96], "recipe": [0.97]}}, {"mixed": 0.97})
    second = _run_json(16, {"mixed": {"loop": [0.99]}, "tiny": {"loop": [0.94]}}, {})  # an older run: no ceiling
    pooled = bench_e2e.pool([first, second])
    loop = pooled["mixed"]["loop"]
    assert (loop["runs"], loop["repeats"], loop["at_target"]) == (2, 3, 2)
    assert loop["ratio"]["median"] == 0.96 and (loop["ratio"]["min"], loop["ratio"]["max"]) == (0.90, 0.99)
    assert loop["over_ceiling_repeats"] == 2 and loop["over_ceiling"]["max"] == pytest.approx(0.96 / 0.97)
    assert pooled["mixed"]["recipe"]["repeats"] == 1 and pooled["tiny"]["loop"]["over_ceiling"] is None
    table = bench_e2e.format_pool(pooled, ["a.json", "b.json"])
    assert "| mixed | ddp-loop | 2 | 3 | 0.960 (0.900..0.990) | 2 of 3 | 0.959 (0.928..0.990) (2) |" in table
    assert "| tiny | ddp-loop | 1 | 1 | 0.940 (0.940..0.940) | 0 of 1 |  (0) |" in table


def test_runs_of_different_lengths_are_not_pooled():
    with pytest.raises(ValueError, match="different --max-steps"):
        bench_e2e.pool([_run_json(16, {"tiny": {"loop": [1.0]}}, {}), _run_json(32, {"tiny": {"loop": [1.0]}}, {})])


@pytest.mark.parametrize("extra", [["--plan-ceiling"], ["--baseline", str(ROOT)]])
def test_pool_refuses_a_setting_it_would_not_use(tmp_path, extra, monkeypatch, capsys):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(_run_json(16, {"tiny": {"loop": [1.0]}}, {})))
    monkeypatch.setattr(sys, "argv", ["bench_e2e.py", "--pool", str(run), *extra])
    with pytest.raises(SystemExit):
        bench_e2e.main()
    assert "--pool only reads earlier runs" in capsys.readouterr().err


def test_pool_reads_runs_from_the_command_line(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(_run_json(16, {"tiny": {"loop": [0.97, 0.93, 0.99]}}, {"tiny": 1.0})))
    monkeypatch.setattr(sys, "argv", ["bench_e2e.py", "--pool", str(run)])
    bench_e2e.main()
    assert "| tiny | ddp-loop | 1 | 3 | 0.970 (0.930..0.990) | 2 of 3 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "mode,extra,named",
    [
        (["--pool", "RUN"], ["--out", "elsewhere.json"], "--out"),
        (["--pool", "RUN"], ["--repeats", "7", "--data", "mixed"], "--repeats, --data"),
        (["--plan-ceiling"], ["--repeats", "7"], "--repeats"),
        (["--plan-ceiling"], ["--configs", "ddp-loop", "--out", "x.json"], "--configs, --out"),
    ],
)
def test_a_mode_running_nothing_refuses_unused_flags(tmp_path, mode, extra, named, monkeypatch, capsys):
    """--pool and --plan-ceiling run no benchmark: a --repeats, --configs or --out given with them is refused by name
    (before, they were silently ignored), and nothing is written."""
    run = tmp_path / "run.json"
    run.write_text(json.dumps(_run_json(16, {"tiny": {"loop": [1.0]}}, {})))
    argv = [str(run) if a == "RUN" else a for a in mode] + extra
    monkeypatch.setattr(sys, "argv", ["bench_e2e.py", *argv])
    with pytest.raises(SystemExit):
        bench_e2e.main()
    err = capsys.readouterr().err
    assert f"would not use {named}" in err, err


def test_stock_peers_launch_same_recipe_own_flags_only(tmp_path):
    (ours,) = runs.command("ddp-recipe", tmp_path, "m.jsonl", 16)
    (stock,) = runs.command("stock-recipe", tmp_path, "m.jsonl", 16)
    (off,) = runs.command("stock-recipe-unused-off", tmp_path, "m.jsonl", 16)
    (sft,) = runs.command("stock-trl", tmp_path, "m.jsonl", 16)
    assert stock[:5] == ours[:5]  # accelerate launch, the 2-process config, the recipe
    assert stock[5:] == [*ours[5:-2], "--trainer", "stock-hf", "--no-balance-ranks", *ours[-2:]]
    assert off[5:] == [
        *ours[5:-2],
        "--trainer",
        "stock-hf",
        "--stock-find-unused",
        "false",
        "--no-balance-ranks",
        *ours[-2:],
    ]
    assert sft[5:] == [*ours[5:-2], "--trainer", "stock-trl", "--no-balance-ranks", *ours[-2:]]
    assert runs.CONFIGS["stock-trl"].stock and not runs.CONFIGS["ddp-trl"].stock


def test_dpo_runs_differ_only_in_trainer_and_order(tmp_path):
    from ddp_ft.tools.bench_e2e import dpo

    (ours,) = runs.command("ddp-dpo", tmp_path, "m.jsonl", 16)
    (strided,) = runs.command("ddp-dpo-strided", tmp_path, "m.jsonl", 16)
    (stock,) = runs.command("stock-dpo", tmp_path, "m.jsonl", 16)
    assert "2cpu_gloo.yaml" in ours[3] and ours[4:6] == ["-m", "ddp_ft.tools.bench_e2e.dpo"]
    assert strided == [*ours[:-2], "--no-balance-ranks", *ours[-2:]]
    assert stock == [*ours[:-2], "--trainer", "stock", "--no-balance-ranks", *ours[-2:]]
    assert runs.CONFIGS["stock-dpo"].stock and not runs.CONFIGS["ddp-dpo"].stock
    for command in (ours, strided, stock):  # the module takes every flag the benchmark gives it
        args = dpo.parse_args(command[6:])
        assert (args.source, args.max_steps, args.output_dir) == ("m.jsonl", 16, str(tmp_path / "ddp"))
    with pytest.raises(SystemExit):
        dpo.parse_args(["--trainer", "stock", "--output-dir", "x"])  # the stock trainer has no balanced plan
    meetings = [{"dialogue": f"d{i}", "summary": f"s{i}"} for i in range(3)]
    assert [(p["chosen"], p["rejected"]) for p in dpo.preference_pairs(meetings)] == [
        ("s0", "s1"),
        ("s1", "s2"),
        ("s2", "s0"),
    ]


def _result(tokens_per_s: float, wall: float | None, losses: list[float], eval_loss: float | None = None) -> dict:
    return {
        "tokens_per_s": tokens_per_s,
        "wall_tokens_per_s": wall,
        "losses": losses,
        "eval_loss": eval_loss,
        "compute_ms_per_1k_tokens": None,
        "wait_share": None,
        "no_wait_tokens_per_s": None,
    }


def test_over_stock_paired_per_repeat_chain_multiplies():
    curve = [2.0, 1.8, 1.7, 1.65, 1.6, 1.62, 1.58, 1.6]
    noisy = [2.0, 1.81, 1.69, 1.66, 1.61, 1.6, 1.59, 1.61]
    # two repeats on a host whose speed halves between them: the paired ratios stay put
    by_config = {
        "stock-recipe": [_result(100, 90, curve, 1.5), _result(50, 45, curve, 1.5)],
        "stock-recipe-unused-off": [_result(104, 93, curve), _result(52, 46.5, curve)],
        "ddp-recipe-strided": [_result(106, 99, [x * (1 + 2e-7) for x in curve]), _result(53, 49.5, curve)],
        "ddp-recipe": [_result(110, 108, noisy, 1.51), _result(55, 54, noisy, 1.51)],
    }
    s = summary.summarize({"mixed": by_config}, {"mixed": 0.97})["mixed"]
    headline = s["vs_stock"]["ddp-recipe/stock-recipe"]
    assert headline["step"]["median"] == pytest.approx(1.10) and headline["step"]["min"] == pytest.approx(1.10)
    assert headline["wall"]["median"] == pytest.approx(1.20)
    links = [(link["from"], link["to"], link["wall"]["median"]) for link in s["stock_chain"]]
    assert [a for a, _, _ in links] == ["stock-recipe", "stock-recipe-unused-off", "ddp-recipe-strided"]
    product = 1.0
    for _, _, ratio in links:
        product *= ratio
    assert product == pytest.approx(headline["wall"]["median"])
    assert "ddp-trl/stock-trl" not in s["vs_stock"]  # not run: not reported

    checks = s["loss_check"]
    assert checks["ddp-recipe-strided/stock-recipe-unused-off"]["same"]  # the stock order: every step to 2e-7
    assert checks["ddp-recipe/stock-recipe"]["same"] and checks["ddp-recipe/stock-recipe"]["eval_loss"] == [1.51, 1.5]

    lines = table.format_stock({"summary": {"mixed": s}})
    assert "| mixed | ddp-recipe/stock-recipe | 1.100 (1.100..1.100) | 1.200 (1.200..1.200) | yes |" in lines
    assert any(
        line.startswith("- mixed ddp-recipe-strided/stock-recipe-unused-off: same: every step") for line in lines
    )


def test_loss_check_tells_other_training_from_same():
    curve = [2.0, 1.8, 1.7, 1.65, 1.6, 1.62, 1.58, 1.6]
    off_by_a_bit = [x * 1.001 for x in curve]
    assert not summary.loss_check(_result(1, 1, off_by_a_bit), _result(1, 1, curve), exact=True)["same"]
    diverged = [2.0, 1.9, 1.9, 1.88, 1.87, 1.86, 1.86, 1.85]  # a run that does not learn the same
    assert not summary.loss_check(_result(1, 1, diverged), _result(1, 1, curve), exact=False)["same"]
    worse_eval = summary.loss_check(_result(1, 1, curve, 1.9), _result(1, 1, curve, 1.5), exact=False)
    assert not worse_eval["same"]
    assert not summary.loss_check(_result(1, 1, curve[:4]), _result(1, 1, curve), exact=False)["same"]


def test_wall_tokens_per_s_spans_first_to_last_step():
    records = [{"type": "config", "world_size": 2}]
    for step, elapsed in enumerate([5.0, 6.0, 7.5, 8.0], 1):
        records.append({"type": "train", "step": step, "tokens": 1000, "step_time_s": 0.4, "elapsed_s": elapsed})
    assert runs.wall_tokens_per_s(records) == pytest.approx(3000 / 3.0)
    assert runs.step_parts(records) == {
        "compute_ms_per_1k_tokens": None,
        "wait_share": None,
        "no_wait_tokens_per_s": None,
    }
    assert runs.wall_tokens_per_s([r for r in records if r["type"] == "config" or r["step"] == 1]) is None
    assert runs.wall_tokens_per_s([{k: v for k, v in r.items() if k != "elapsed_s"} for r in records]) is None


def test_picture_labels_ddp_and_stock_bars_by_ratio(tmp_path):
    curve = [2.0, 1.8, 1.7, 1.6]
    by_config = {
        "pair-recipe": [_result(200, 190, curve)],
        "ddp-recipe": [_result(190, 185, curve)],
        "stock-recipe": [_result(170, 160, curve)],
    }
    result = {"summary": summary.summarize({"tiny": by_config}, {"tiny": 1.0})}
    s = result["summary"]["tiny"]
    assert table._bar_label(s, "ddp-recipe") == "95%" and table._bar_label(s, "stock-recipe") == "ddp_ft x1.16"
    assert table._bar_label(s, "pair-recipe") == ""
    assert table.plot(result, tmp_path / "e2e.png").stat().st_size > 10_000
