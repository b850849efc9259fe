"""scripts/bench_e2e.py's launches and table (the benchmark itself runs minutes; its numbers are in the README)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "scripts" / "bench_e2e.py")
bench_e2e = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_e2e)


def test_a_pair_is_two_single_processes_and_ddp_one_two_rank_launch_on_the_same_settings(tmp_path):
    pair = bench_e2e._command("pair-loop", tmp_path, "m.jsonl", 16)
    ddp = bench_e2e._command("ddp-loop", tmp_path, "m.jsonl", 16)
    assert len(pair) == 2 and len(ddp) == 1
    assert [c[1:2] for c in pair] == [[str(ROOT / "scripts/train.py")]] * 2
    assert ddp[0][1:3] == ["--standalone", "--nproc_per_node=2"]
    flags = ["--preset", "tiny", "--report-to", "none", "--max-steps", "16", "--source", "m.jsonl"]
    assert all(c[-len(flags) - 2 : -2] == flags for c in [*pair, *ddp])  # then --output-dir DIR
    assert {c[-1] for c in pair} == {str(tmp_path / "alone0"), str(tmp_path / "alone1")}
    recipe_pair, (recipe_ddp,) = (
        bench_e2e._command("pair-recipe", tmp_path, None, 8),
        bench_e2e._command("ddp-recipe", tmp_path, None, 8),
    )
    assert all("single.yaml" in c[3] for c in recipe_pair) and "2cpu_gloo.yaml" in recipe_ddp[3]
    assert "--source" not in recipe_ddp


def test_the_table_gives_ddp_over_the_pair_per_data_set():
    t = {"median": 100.0, "min": 90.0, "max": 110.0, "all": []}
    result = {
        "command": "python scripts/bench_e2e.py",
        "hardware": "cpu",
        "summary": {
            "mixed": {
                "pair-loop": {"tokens_per_s": t},
                "ddp-loop": {"tokens_per_s": t, "imbalance": 1.02, "wait_for_slowest_ms": 3.0},
                "ddp_over_pair_loop": {"median": 0.97, "min": 0.95, "max": 0.99, "all": []},
            }
        },
    }
    table = bench_e2e.format_table(result)
    assert "| mixed | ddp-loop | 100 (90..110) | 0.970 (0.950..0.990) | 1.020 | 3.0 |" in table
    assert "| mixed | pair-loop | 100 (90..110) |  |  |  |" in table
