"""The ddp-ft command: help for every subcommand, errors before anything launches, a 2-rank train under its own
torchrun that writes a run_config.yaml which reruns it, the recipe on 2 ranks, and the doctor passing and failing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_ft.commands import cli, doctor, launcher
from ddp_ft.report.forecast import PROBE_FILE
from ddp_ft.report.metrics import read_jsonl
from ddp_ft.tools.forecast_check.stages import one_visible_gpu
from ddp_ft.training.checkpoint import DATA_FILE, FINAL_DIR
from ddp_ft.training.config import RUN_CONFIG, parse_settings

from ..helpers.dist_harness import PYTHONPATH

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _env() -> dict:
    return {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": PYTHONPATH,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _run(command: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_subcommand_with_its_line(tmp_path):
    run = _run([sys.executable, "-m", "ddp_ft", "--help"], tmp_path, timeout=60)  # ddp_ft/__main__.py
    assert run.returncode == 0, run.stderr
    for name in cli.SUBCOMMANDS:
        assert f"    {name}" in run.stdout, name
    assert "Preflight under the launcher" in run.stdout and "usage: ddp-ft" in run.stdout


@pytest.mark.parametrize(
    "name,flags",
    [
        ("train", ["--nproc", "--config", "--preset", "--micro_batch", "--bucket_cap_mb", "--backend"]),
        (
            "recipe",
            ["--nproc", "--trainer {hf,trl,stock-hf,stock-trl}", "--stock-find-unused", "--config", "--micro_batch"],
        ),
        ("compare", ["baseline_dir", "--out", "--independent", "--forecast"]),
        ("forecast", ["RUN", "--nproc N", "--link {pcie4,pcie5,nvlink,infiniband,measured}", "--probe", "--out"]),
        ("doctor", ["--nproc", "--expect-world-size", "--backend {auto,nccl,gloo}", "--sizes", "--out"]),
        ("ladder", ["--nproc", "--rungs", "--workloads"]),
        ("bucket-sweep", ["--nproc", "--caps", "--no-auto"]),
        ("bench-comm", ["--nproc", "--sizes", "--byte-budget"]),
        ("merge", ["RUN_OR_ADAPTER", "--out", "--base {trained,original}", "--dtype", "--base-model", "--device"]),
    ],
)
def test_every_subcommand_documents_its_settings(name, flags, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([name, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: ddp-ft {name}"), text[:200]
    assert all(flag in text for flag in flags), text


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["training"], "invalid choice: 'training'"),
        (["train", "--preset", "tiny", "--nproc", "3"], "effective_batch=8 is not divisible"),
        (["train", "--config", "missing.yaml", "--nproc", "2"], "--config missing.yaml: cannot read it"),
        (["train", "--config", "tiny.yaml", "--nproc", "2"], "tiny is a preset ddp_ft ships: use --preset tiny."),
        (["recipe", "--trainer", "jax", "--nproc", "2"], "--trainer: invalid choice: 'jax'"),
        (["train", "--preset", "tiny", "--liger", "--nproc", "2"], "--liger (liger: true): Liger's kernels are Triton"),
        (
            ["recipe", "--preset", "tiny", "--liger", "--nproc", "2"],
            "--liger (liger: true): Liger's kernels are Triton",
        ),
        (["train", "--learning-rate", "-1", "--nproc", "2"], "learning_rate=-1.0: must be a positive number; e.g."),
        (["recipe", "--preset", "tiny", "--lora-dropout", "1", "--nproc", "2"], "lora_dropout=1.0: must be in [0, 1)"),
        (  # a wrong local --source: refused here, not by every worker after its start-up
            ["train", "--preset", "tiny", "--source", "missing.jsonl", "--nproc", "2"],
            "DataSettings.source='missing.jsonl': no such file",
        ),
        (["ladder", "--nproc", "1"], "--nproc 1: ladder needs at least 2"),
        (["bench-comm", "--repeats", "0"], "--repeats must be at least 1"),
        (["doctor", "--expect-world-size", "0", "--nproc", "2"], "--expect-world-size must be at least 1"),
        (["doctor", "--backend", "nccl", "--nproc", "2"], "--backend nccl but torch.cuda.is_available() is False"),
        (["train", "--backend", "nccl", "--nproc", "2"], "--backend nccl but torch.cuda.is_available() is False"),
        (["recipe", "--preset", "tiny", "--backend", "mpi", "--nproc", "2"], "backend='mpi': choose one of auto"),
        (["merge", "run", "--out", "o", "--device", "tpu"], "MergeSettings.device='tpu' (--device): choose auto"),
        (["forecast", "run", "--nproc", "0"], "--nproc 0: give the processes per machine, 1 or more"),
        (["forecast", "run", "--nproc", "2", "--probe", "p"], "--probe is read by --link measured"),
    ],
)
def test_wrong_input_names_setting_before_workers(argv, needle, capsys, monkeypatch):
    monkeypatch.setattr(cli, "launch", lambda *a, **k: pytest.fail(f"launched {a}"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as error:
        cli.main(argv)
    assert error.value.code == 2
    assert needle in capsys.readouterr().err


def test_one_gpu_takes_two_ranks_over_gloo_only(capsys, monkeypatch):
    """On one GPU (mocked) two NCCL ranks are refused before launch, naming --backend gloo; gloo launches."""
    launched = []
    monkeypatch.setattr(cli, "launch", lambda *args: launched.append(args[-2]) or 0)
    monkeypatch.setattr(cli, "same_threads_for_any_nproc", lambda prog: None)  # this process's threads kept
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as error:
        cli.main(["train", "--preset", "tiny", "--nproc", "2"])
    assert error.value.code == 2 and "1 GPU(s) visible: NCCL" in capsys.readouterr().err
    assert cli.main(["train", "--preset", "tiny", "--nproc", "2", "--backend", "gloo"]) == 0
    assert launched == [["--preset", "tiny", "--backend", "gloo"]]


def test_no_tokenizer_or_unwritable_output_fails_first(tmp_path, capsys, monkeypatch):
    """Refused by ddp-ft itself, naming the folder and the fix, where the ranks failed after their start-up (a new
    run in a folder an earlier run filled among them)."""
    monkeypatch.setattr(cli, "launch", lambda *a, **k: pytest.fail(f"launched {a}"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model, empty, taken = tmp_path / "model", tmp_path / "empty", tmp_path / "taken"
    model.mkdir()
    empty.mkdir()
    taken.write_text("a file")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text('{"type": "train", "step": 1}\n')
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")  # as model.save_pretrained leaves it: no tokenizer
    tiny = ["--preset", "tiny", "--output-dir"]
    for argv, needle in [
        (["train", "--model-name-or-path", str(model)], f"{model} holds no tokenizer (no tokenizer.json"),
        (["recipe", "--model-name-or-path", str(empty)], f"{empty} holds no config.json, so it is no saved model"),
        (["recipe", *tiny, str(taken)], f"--output-dir {taken} is a file. Give --output-dir a folder"),
        (["train", *tiny, str(taken / "run")], f"--output-dir {taken / 'run'} cannot be created: {taken} is a file"),
        (["recipe", *tiny, str(tmp_path / "used")], f"--output-dir {tmp_path / 'used'} holds an earlier run"),
    ]:
        with pytest.raises(SystemExit) as error:
            cli.main([*argv, "--nproc", "2"])
        assert error.value.code == 2 and needle in capsys.readouterr().err, argv
    assert "AutoTokenizer.from_pretrained(ORIGIN).save_pretrained" in str(_refusal(model))
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only filesystem (root writes anywhere else)
    with pytest.raises(SystemExit):
        cli.main(["train", *tiny, str(tmp_path / "new" / "run"), "--nproc", "2"])
    assert f"(it would be created in {tmp_path}, which this user cannot write)" in capsys.readouterr().err


def _refusal(model_folder: Path) -> ValueError:
    from ddp_ft.training.model.source import check_model_source

    with pytest.raises(ValueError) as error:
        check_model_source(str(model_folder))
    return error.value


def test_no_tokenizer_ends_in_seconds_with_no_worker(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    command = [sys.executable, "-m", "ddp_ft.commands.cli", "train", "--model-name-or-path", "model", "--nproc", "2"]
    run = _run(command, tmp_path, timeout=120)
    assert run.returncode == 2 and "model holds no tokenizer" in run.stderr, run.stderr[-3000:]
    assert "[rank" not in run.stderr and "sentencepiece" not in run.stderr  # no worker started


@pytest.mark.parametrize(
    "config,needle",
    [
        ("learning_rate: abc\n", "learning_rate: 'abc' is a str; learning_rate takes a float."),  # the file's type
        ("lora_dropout: 3\n", "lora_dropout=3.0: must be in [0, 1); e.g. lora_dropout=0.05"),  # the range check
    ],
)
def test_config_error_is_one_line_pointing_to_help(config, needle, tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text(config)
    with pytest.raises(SystemExit) as error:
        cli.main(["train", "--config", str(tmp_path / "bad.yaml"), "--nproc", "2"])
    assert error.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("ddp-ft train: error: ") and needle in lines[0], lines
    assert lines[1] == "ddp-ft train --help lists the settings."  # no usage: 45 lines before the one that matters


def test_nproc_help_says_its_default_once(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "WORLD_SIZE. Default: 1" in text and "(default: None)" not in text


def test_nproc_off_worker_argv_and_sigusr1_forwarded():
    assert cli.strip_option(["--a", "1", "--nproc", "2", "--b", "--nproc=3"], "--nproc") == ["--a", "1", "--b"]
    args = launcher.torchrun_args("ddp_ft.commands.train", 2, ["--preset", "tiny"])
    assert args == [
        "--standalone",
        "--nproc_per_node=2",
        "--signals-to-handle=SIGTERM,SIGHUP,SIGQUIT,SIGUSR1",  # torchrun's lacks SLURM's SIGUSR1; SIGINT: ddp-ft's
        "-m",
        "ddp_ft.commands.train",
        "--preset",
        "tiny",
    ]


@pytest.mark.distributed
@pytest.mark.slow
def test_train_from_config_writes_a_rerunnable_config(tmp_path):
    flags = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--max-steps", "2", "--save-every", "0"]
    flags += ["--report-to", "none", "--output-dir", str(tmp_path / "run"), "--lora-r", "4", "--backend", "gloo"]
    run = _run([sys.executable, "-m", "ddp_ft.commands.cli", "train", "--nproc", "2", *flags], tmp_path)
    assert run.returncode == 0, run.stderr[-6000:]
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    config = [r for r in records if r["type"] == "config"]
    assert len(config) == 1 and config[0]["world_size"] == 2 and config[0]["backend"] == "gloo"
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2]
    written = tmp_path / "run" / RUN_CONFIG
    # what ran: the device's defaults resolved (on the CPU compile and packing off, checkpointing on): a rerun runs the same
    assert parse_settings(["--config", str(written)]) == parse_settings(
        [*flags, "--no-compile", "--packing", "false", "--gradient-checkpointing", "true"]
    )
    final = tmp_path / "run" / FINAL_DIR  # the adapter with its tokenizer and data settings, as the recipe's
    assert all((final / name).is_file() for name in ("adapter_model.safetensors", "tokenizer_config.json", DATA_FILE))


@pytest.mark.distributed
@pytest.mark.slow
def test_recipe_nproc_2_is_bucketed_ddp_not_two_copies(tmp_path):
    flags = ["--preset", "tiny", "--max-steps", "1", "--save-every", "0", "--report-to", "none"]
    run = _run(
        [sys.executable, "-m", "ddp_ft.commands.cli", "recipe", "--nproc", "2", *flags, "--output-dir", "out"], tmp_path
    )
    assert run.returncode == 0, run.stderr[-6000:]
    assert "2 process(es)" in run.stderr and "wrapped the model in BucketedDDP" in run.stderr
    assert "world size 2" in run.stderr
    assert (tmp_path / "out" / RUN_CONFIG).exists()
    final = tmp_path / "out" / FINAL_DIR
    assert all((final / name).is_file() for name in ("adapter_model.safetensors", "tokenizer_config.json", DATA_FILE))


@pytest.mark.distributed
def test_doctor_on_two_cpu_ranks_prints_one_table(tmp_path):
    command = [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "ddp_ft.commands.cli",
        "doctor",
        "--backend",
        "gloo",
        "--sizes",
        "4K",
        "64K",
        "--out",
        str(tmp_path / "probe"),
    ]
    run = _run(command, tmp_path, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.count("check ") == 1 and "All checks passed." in run.stdout, run.stdout
    for row in ("world size", "accelerate world", "devices", "backend", "precision", "torch", "all-reduce"):
        assert f"\n{row} " in run.stdout, row
    assert "FAIL" not in run.stdout and "backend           PASS    gloo on cpu" in run.stdout
    probe = json.loads((tmp_path / "probe" / PROBE_FILE).read_text())  # what ddp-ft forecast --link measured fits
    timed = sorted((r["nbytes"], r["world_size"]) for r in probe["all_reduce"] if r["method"] == "backend")
    assert timed == [(4096, 2), (65536, 2)] and probe["backend"] == "gloo"


@pytest.mark.cuda
def test_doctor_over_gloo_on_one_gpu_times_the_ring(tmp_path, gpu_environment):
    """The probe ``make gpu-report``'s forecast check reads: 2 ranks sharing one GPU over gloo. gloo's send and recv
    read host memory only, so the hand-written ring must stage CUDA tensors (a device pointer aborted a rank)."""
    env = {**gpu_environment, "PYTHONPATH": PYTHONPATH, "CUDA_VISIBLE_DEVICES": one_visible_gpu(gpu_environment)}
    command = [sys.executable, "-m", "ddp_ft", "doctor", "--nproc", "2", "--device", "cuda", "--backend", "gloo"]
    command += ["--sizes", "64K", "1M", "--repeats", "2", "--out", str(tmp_path / "probe")]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    probe = json.loads((tmp_path / "probe" / PROBE_FILE).read_text())
    timed = sorted((r["method"], r["nbytes"]) for r in probe["all_reduce"])
    assert timed == [("backend", 65536), ("backend", 2**20), ("ring", 65536), ("ring", 2**20)]
    assert probe["device"] == "cuda" and probe["backend"] == "gloo"


@pytest.mark.distributed
def test_doctor_one_of_two_processes_prints_fix_exit_1(tmp_path):
    """The common slip: ``python ...`` where ``torchrun`` was meant (one process, no launcher variables)."""
    command = [sys.executable, "-m", "ddp_ft.commands.cli", "doctor", "--nproc", "1", "--expect-world-size", "2"]
    run = _run([*command, "--sizes", "4K"], tmp_path, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr[-4000:]
    assert "world size        FAIL    1 process(es) launched (WORLD_SIZE=unset), 2 expected" in run.stdout, run.stdout
    assert "fix:    launch 2: ddp-ft train --nproc 2, torchrun --nproc_per_node 2" in run.stdout
    assert "1 check(s) failed." in run.stdout


def test_doctor_names_fix_for_lone_process_shared_gpu():
    seen_one = doctor.check_accelerate(2, 1, environ={"WORLD_SIZE": "2", "RANK": "1"})
    assert not seen_one.ok and "rank 1 of WORLD_SIZE=2" in seen_one.fix and "cpu=True" in seen_one.fix
    other = doctor.check_accelerate(4, 2, environ={"WORLD_SIZE": "4"})
    assert not other.ok and "the launcher started 4" in other.detail
    assert doctor.check_accelerate(2, 2, environ={"WORLD_SIZE": "2"}).ok
    shared = doctor.check_devices([("host", "cuda:0"), ("host", "cuda:0")], torch.device("cuda", 0), "nccl")
    assert not shared.ok and "ranks 0 and 1 both on cuda:0 of host" in shared.detail and "one GPU" in shared.fix
    assert "--backend gloo" in shared.fix
    chosen = doctor.check_devices([("host", "cuda:0"), ("host", "cuda:0")], torch.device("cuda", 0), "gloo")
    assert chosen.ok and chosen.detail == "ranks 0 and 1 share cuda:0 of host over gloo (by choice: --backend gloo)"
    old_gpu = doctor.check_precision("bfloat16", torch.device("cpu"))
    assert old_gpu.ok and old_gpu.detail.startswith("bfloat16")
    merged = doctor.merge([[doctor.Check("devices", True, "fine")], [doctor.Check("devices", False, "bad", "fix it")]])
    assert merged == [doctor.Check("devices", False, "rank 1: bad", "fix it")]
    table = doctor.format_table(merged)
    assert "devices  FAIL    rank 1: bad" in table and "fix:    fix it" in table and "1 check(s) failed." in table


@pytest.mark.distributed
def test_bench_comm_runs_its_module_under_torchrun(tmp_path):
    out = tmp_path / "comm.json"
    flags = ["--sizes", "4K", "--repeats", "1", "--warmup", "0", "--device", "cpu", "--out", str(out)]
    run = _run([sys.executable, "-m", "ddp_ft.commands.cli", "bench-comm", *flags], tmp_path, timeout=120)  # --nproc: 2
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "| 4 KiB |" in run.stdout and out.exists() and out.with_suffix(".png").exists()


def test_silent_rank_death_named_by_signal_or_status(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    killed = ProcessFailure(local_rank=1, pid=4242, exitcode=-9, error_file=str(tmp_path / "none.json"))
    line = launcher.failure_line("ddp-ft train", ChildFailedError("train", {1: killed}), tmp_path, since=0.0)
    assert line == (
        "ddp-ft train: rank 1 failed: Signal 9 (SIGKILL) received by PID 4242 (no traceback recorded: see the output "
        "above)"
    )
    exited = ProcessFailure(local_rank=0, pid=4243, exitcode=1, error_file=str(tmp_path / "none.json"))
    line = launcher.failure_line("ddp-ft doctor", ChildFailedError("doctor", {0: exited}), tmp_path, since=0.0)
    assert line == "ddp-ft doctor: rank 0 failed: exit status 1 (no traceback recorded: see the output above)"


def test_nproc_1_gets_the_threads_of_each_nproc_2_rank(tmp_path, monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 for N > 1 workers when it is unset, and nothing for one; ddp-ft gives one
    process the same, so the two runs of compare's --help compare. A user's OMP_NUM_THREADS is kept."""
    from torch.distributed.run import config_from_args
    from torch.distributed.run import parse_args as torchrun_parse_args

    monkeypatch.setenv("OMP_NUM_THREADS", "restored after the test")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config_from_args(torchrun_parse_args(launcher.torchrun_args("ddp_ft.commands.train", 2, [])))
    by_torchrun = os.environ.pop("OMP_NUM_THREADS")
    seen = {}
    monkeypatch.setattr(
        cli, "launch", lambda prog, module, nproc, *a: seen.update({nproc: os.environ["OMP_NUM_THREADS"]})
    )
    monkeypatch.setattr(
        cli, "_in_process", lambda *a: seen.update({1: (os.environ["OMP_NUM_THREADS"], torch.get_num_threads())})
    )
    before = torch.get_num_threads()
    try:
        for nproc in ("2", "1"):
            os.environ.pop("OMP_NUM_THREADS", None)
            cli.main(["train", "--preset", "tiny", "--nproc", nproc, "--output-dir", str(tmp_path / "run")])
        assert seen == {2: by_torchrun, 1: (by_torchrun, int(by_torchrun))} and by_torchrun == "1"
        os.environ["OMP_NUM_THREADS"] = "2"
        cli.main(["recipe", "--preset", "tiny", "--output-dir", str(tmp_path / "run")])
        assert seen[1] == ("2", 2)
    finally:
        torch.set_num_threads(before)
