"""What a user runs, measured end to end for ``make gpu-report``: the loop and the recipe at their defaults and at the
old ones, the stock Trainer at the reference write-up's settings, sequence 2,048 packed, and the decomposition of
compile and checkpointing at micro-batch 1 and ``auto``.

Each end-to-end step is ``python -m ddp_ft.tools.gpu_report.e2e --out RESULT.json -- COMMAND...``: the training command
runs as a user would start it (``--output-dir`` pointing into the report's folder), then its ``metrics.jsonl`` is
read into the result JSON: non-padding tokens/s per optimizer step (the median of the steps after the first, which
carries compilation and the micro-batch probe), the same by the wall clock (the gaps between steps included), the
MFU of a Qwen3 model on a GPU of known peak, the measured peak and the probe's expected peak, the compile
counters and time, the micro-batch and accumulation that ran. Each run logs Dynamo's reason for every
recompilation (``TORCH_LOGS=recompiles``). The model is a random-weight Qwen3-4B built by
``scripts/random_model.py`` with the tokenizer in ``--data``, the data the AMI meetings there; without them the
end-to-end steps are skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from ...report.records import METRICS_FILE
from ..bench_e2e.runs import wall_tokens_per_s
from .runner import Step, write_report


def read_run(metrics: Path) -> dict:
    """The result of one training run from its ``metrics.jsonl``."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    config = next((r for r in rows if r.get("type") == "config"), {})
    steps = [r for r in rows if r.get("type") == "train" and "tokens_per_s" in r]
    timed = steps[1:] or steps
    rates = [r["tokens_per_s"] for r in timed]
    last = steps[-1] if steps else {}
    peak = max((r.get("peak_mem_gb", 0.0) for r in steps), default=None)
    return {
        "steps": len(steps),
        "micro_batch": config.get("micro_batch"),
        "accumulation": config.get("accumulation"),
        "gradient_checkpointing": config.get("gradient_checkpointing"),
        "tokens_per_s": statistics.median(rates) if rates else None,
        "tokens_per_s_range": [min(rates), max(rates)] if rates else None,
        "wall_tokens_per_s": wall_tokens_per_s(rows),  # the gaps between steps included
        "first_step_s": steps[0].get("step_time_s") if steps else None,
        "peak_allocated_gb": peak,
        "expected_peak_gb": last.get("expected_peak_gb"),
        "compile": {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("compile/")},
        "losses": [r.get("loss") for r in steps],
    }


def e2e_summary(result: dict, done: dict[str, dict]) -> tuple[dict, list[str]]:
    """Headline of one end-to-end step; expected against measured peak beyond 10%, or a graph compiled after
    step 1, is a problem."""
    rate, peak, expected = result.get("tokens_per_s"), result.get("peak_allocated_gb"), result.get("expected_peak_gb")
    wall = result.get("wall_tokens_per_s")
    parts = [f"{rate:,.0f} non-padding tokens/s" if rate else "no step timed"]
    parts += [f"{wall:,.0f} by the wall clock"] if wall else []
    parts += [f"MFU {result['mfu']:.1%}"] if result.get("mfu") else []
    parts.append(f"micro-batch {result.get('micro_batch')} x {result.get('accumulation')}")
    if result.get("gradient_checkpointing") is not None:
        parts.append(f"checkpointing {'on' if result['gradient_checkpointing'] else 'off'}")
    if peak:
        parts.append(f"peak {peak:.2f} GB" + (f" (expected {expected:.2f}: {peak / expected:.0%})" if expected else ""))
    compiled = result.get("compile", {})
    if compiled.get("time_s"):
        parts.append(f"compile {compiled['time_s']:.0f} s, {compiled.get('graphs')} graphs")
    problems = []
    if late := compiled.get("recompiles"):
        problems.append(f"{late} graph{'s' if late > 1 else ''} compiled after step 1; the step's log names why")
    if peak and expected and abs(peak / expected - 1) > 0.10:
        problems.append(f"measured peak {peak:.2f} GB is {peak / expected:.0%} of the expected {expected:.2f} GB")
    return {**result, "headline": ", ".join(parts)}, problems


def run_mfu(output_dir: Path, tokens_per_s: float | None, device_name: str) -> float | None:
    """The run's MFU on ``device_name`` (``ddp_ft.tools.bench.MFU_FORMULA``), from its ``run_config.yaml``.

    None for a model that is no Qwen3 shape, a float32 run, or a GPU without a known peak.
    """
    import torch
    import yaml
    from transformers import AutoConfig

    from ...training.model.memory import Qwen3Shape
    from ..bench import peak_tflops, qlora_training_flops

    config = yaml.safe_load((output_dir / "run_config.yaml").read_text())
    dtype = torch.float32 if config["model"]["compute_dtype"] == "float32" else torch.bfloat16
    peak = peak_tflops(device_name, dtype)
    if not tokens_per_s or peak is None:
        return None
    try:
        shape = Qwen3Shape.from_config(AutoConfig.from_pretrained(config["model"]["model_name_or_path"]))
    except (OSError, ValueError, AttributeError):  # an embedded or hub model, or another architecture
        return None
    flops = qlora_training_flops(shape, config["data"]["max_seq_len"], config["lora"]["lora_r"])
    return tokens_per_s * flops.per_token / (peak * 1e12)


def run_and_read(command: list[str], output_dir: Path, out: Path) -> int:
    """Run ``command`` (its ``--output-dir`` is ``output_dir``, emptied first: a report run again measures anew), then
    write the run's result to ``out``."""
    import torch

    shutil.rmtree(output_dir, ignore_errors=True)
    status = subprocess.run(command, check=False).returncode
    metrics = output_dir / METRICS_FILE
    if status == 0 and metrics.exists():
        result = read_run(metrics)
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
        result["mfu"] = run_mfu(output_dir, result["tokens_per_s"], name)
        write_report({"command": command, **result}, out)
    return status


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the result JSON")
    p.add_argument("--output-dir", type=Path, required=True, help="the run's --output-dir")
    args = p.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        p.error("give the training command after --")
    return run_and_read([*command, "--output-dir", str(args.output_dir)], args.output_dir, args.out)


if __name__ == "__main__":
    sys.exit(main())


# ---------------------------------------------------------------- the report's steps

DATA_FILES = ("qwen2-tokenizer", "ami/ami_abstractive.jsonl")  # what the end-to-end steps read from ``--data``
CPU_SMOKE = ["--preset", "tiny", "--max-steps", "2", "--report-to", "none"]
# Packing's cost: 40 short texts fill about 8 rows of 2,048, as packed_2048's micro-batch of 8 full rows.
SHORT = ["--format", "text", "--max-seq-len", "2048", "--packing", "true"]  # fmt: skip
SHORT += ["--micro-batch", "40", "--effective-batch", "80"]
OLD_DEFAULTS = ["--micro-batch", "1", "--no-compile", "--packing", "false"]  # the seed's: micro-batch 1, eager, padded
CPU_SKIP = "CUDA only: the CPU smoke test runs loop_defaults"
MODEL = ("random_model",)  # what every end-to-end step on CUDA trains


def _measured(
    python: str, results: Path, name: str, title: str, command: list[str], expected_s: float, skip, needs
) -> Step:
    """One end-to-end step: ``command`` run by this module's wrapper, which reads its metrics into ``name.json``."""
    out = results / f"{name}.json"
    wrapped = [python, "-m", "ddp_ft.tools.gpu_report.e2e", "--out", str(out), "--output-dir", str(results / name)]
    return Step(
        name,
        title,
        [*wrapped, "--", *command],
        out,
        expected_s,
        3 * expected_s,
        skip,
        env={"TORCH_LOGS": recompile_logs()},
        summarize=e2e_summary,
        needs=needs,
    )


def recompile_logs() -> str:
    """``TORCH_LOGS`` with Dynamo's reasons for each recompilation added: the step's log says why any graph was
    compiled again."""
    return ",".join(name for name in (os.environ.get("TORCH_LOGS"), "recompiles") if name)


def e2e_steps(device: str, results: Path, scripts: Path, python: str, data: Path | None = None) -> list:
    """The end-to-end steps, most valuable first: the defaults of the loop and the recipe, sequence 2,048 packed, the
    old defaults, the stock Trainer at the reference write-up's settings. On the CPU only the loop's defaults
    run, on the tiny preset (the smoke test of the mechanism); the rest needs CUDA and is skipped there. Without
    ``data`` (a folder holding ``DATA_FILES``) the CUDA steps are skipped too, saying so."""
    cuda = device == "cuda"
    tokenizer, ami = ((data or Path("DATA")) / name for name in DATA_FILES)
    model = results / "qwen3-4b-random"
    missing = ([str(p) for p in (tokenizer, ami) if not p.exists()] if data else ["--data"]) if cuda else []
    no_data = f"needs {' and '.join(missing)} (the tokenizer and the AMI meetings)" if missing else None
    base = ["--preset", "qwen3-4b-ami", "--model-name-or-path", str(model), "--source", str(ami)]
    base += ["--report-to", "none"]
    root = scripts.parent
    launch = [python, "-m", "accelerate.commands.launch", "--config_file", str(root / "accelerate_configs/single.yaml")]
    train, recipe = [python, str(scripts / "train.py")], [*launch, str(root / "recipes" / "qwen_ami.py")]
    cuda_skip = no_data if cuda else CPU_SKIP

    def run(name: str, title: str, command: list[str], expected_s: float, cuda_only: bool = True, needs=MODEL) -> Step:
        skip = cuda_skip if cuda_only else no_data
        return _measured(python, results, name, title, command, expected_s, skip, needs if cuda else ())

    build = [python, str(scripts / "random_model.py"), "--tokenizer", str(tokenizer), "--out", str(model)]
    steps = [Step("random_model", "a random-weight Qwen3-4B (no download)", build, None, 45, 300, skip=no_data)]
    steps = steps if cuda else []
    texts = results / "pieces.jsonl"
    pieces = [python, "-m", "ddp_ft.tools.gpu_report.pieces", "--source", str(ami), "--out", str(texts)]
    short = [*train, *base, *SHORT, "--source", str(texts), "--max-steps", "5"]
    loop_defaults = [*train, *base, "--max-steps", "16"] if cuda else [*train, *CPU_SMOKE]
    return steps + [
        run(
            "loop_defaults",
            "the loop at its defaults (micro-batch auto, compile, packing)",
            loop_defaults,
            120 if cuda else 40,
            cuda_only=False,
        ),
        run("recipe_defaults", "the Trainer recipe at its defaults", [*recipe, *base, "--max-steps", "16"], 95),
        run(
            "packed_2048",
            "the loop at its defaults, sequence 2,048 packed (Unsloth's published shape)",
            [*train, *base, "--max-seq-len", "2048", "--packing", "true", "--max-steps", "6"],
            90,
        ),
        Step("pieces", "AMI cut into 280-word texts (packing's cost)", pieces, None, 5, 60, skip=cuda_skip),
        run(
            "packed_2048_short",
            "the loop at sequence 2,048, five short texts packed per row (against packed_2048's one), at the defaults",
            short,
            100,
            needs=(*MODEL, "pieces"),
        ),
        run(
            "packed_2048_short_sdpa",
            "the same through sdpa, which computes the blocks the mask hides (attention auto: flex there)",
            [*short, "--attention", "sdpa"],
            100,
            needs=(*MODEL, "pieces"),
        ),
        run(
            "loop_old_defaults",
            "the loop at the old defaults (micro-batch 1, eager, padded)",
            [*train, *base, *OLD_DEFAULTS, "--max-steps", "3"],
            50,
        ),
        run(
            "stock_reference",
            "the stock Trainer at the reference write-up's settings (micro-batch 1, eager)",
            [*recipe, *base, *OLD_DEFAULTS, "--trainer", "stock-hf", "--max-steps", "3"],
            50,
        ),
        run(
            "loop_half_micro_batch",
            "the loop at micro-batch 8 x 2: the micro-step of 2 GPUs at effective batch 16, for ddp-ft forecast",
            [*train, *base, "--micro-batch", "8", "--max-steps", "16"],
            110,
        ),
    ]
