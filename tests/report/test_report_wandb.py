"""Online runs: the comparison reads a wandb run's history as it reads a metrics.jsonl."""

from ddp_ft.report.comparison import compare_runs, records_from_wandb, summarize_run


class _FakeRun:
    def __init__(self, name, world_size, losses, tokens_per_s):
        self.name = name
        self.config = {"world_size": world_size, "effective_batch": 8, "micro_batch": 2}
        self._rows = [
            {
                "_step": i,
                "train/samples_seen": 8 * (i + 1),
                "train/loss": loss,
                "train/tokens_per_s": tokens_per_s,
                "train/tokens_per_s_per_device": tokens_per_s / world_size,
                "train/step_time_s": 1.0,
            }
            for i, loss in enumerate(losses)
        ]
        self._rows.append({"_step": len(losses), "train/samples_seen": 8 * len(losses), "eval/loss": losses[-1]})

    def scan_history(self):
        return iter(self._rows)


class _FakeApi:
    def __init__(self, runs):
        self.runs = runs

    def run(self, path):
        return self.runs[path]


def test_history_becomes_records_like_local_runs():
    api = _FakeApi(
        {
            "me/ddp_ft/single": _FakeRun("single-1", 1, [3.0, 2.5, 2.0, 1.5], 1000.0),
            "me/ddp_ft/ddp": _FakeRun("ddp-2", 2, [3.0, 2.5, 2.1, 1.5], 1900.0),
        }
    )
    single = records_from_wandb("me/ddp_ft/single", api=api)
    ddp = records_from_wandb("me/ddp_ft/ddp", api=api)
    assert single[0] == {
        "type": "config",
        "run_name": "single-1",
        "world_size": 1,
        "effective_batch": 8,
        "micro_batch": 2,
    }
    assert [r["loss"] for r in single if r["type"] == "train"] == [3.0, 2.5, 2.0, 1.5]
    assert [r["eval_loss"] for r in ddp if r["type"] == "eval"] == [1.5]
    comparison = compare_runs(summarize_run(single), single, summarize_run(ddp), ddp)
    assert comparison.speedup == 1.9
    assert abs(comparison.loss_gap_max - 0.1) < 1e-9 and comparison.matched_points == 4
