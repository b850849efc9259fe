"""examples/: each script runs as its docstring says, at 2 ranks, data-parallel; the SLURM script's command lines and
its requeue logic, checked with stub ``srun`` / ``scontrol`` (SLURM itself cannot run here)."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.run

from ddp_ft.training.config import parse_settings

from ..helpers.dist_harness import PYTHONPATH

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
# Not anchored: the ranks share the launcher's stdout, so one rank's line can land in the middle of the other's.
FINAL_LINE = re.compile(r"rank (\d+) of world_size=(\d+): (\d+) steps, adapter checksum (-?\d+(?:\.\d+)?(?:e[-+]\d+)?)")


# An upstream notice as Python's warnings module or bitsandbytes' logger prints it (possibly after a progress bar's \r).
NOTICE = re.compile(r"\S+\.py:\d+: \w*Warning: [^\n]*|Failed to load CPU gemm_4bit_forward[^\n]*")
BITSANDBYTES_IMPORT_NOTICE = "Failed to load CPU gemm_4bit_forward"


def _launch(launcher: str, script: str, tmp_path: Path) -> tuple[str, str]:
    if launcher == "accelerate":
        command = [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs/2cpu_gloo.yaml")]
    else:
        command = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH}
    run = subprocess.run(
        [*command, str(ROOT / "examples" / script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-6000:])
    return run.stdout, run.stderr


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "launcher"),
    [
        ("plain_torch.py", "torchrun"),
        ("accelerate_loop.py", "accelerate"),
        ("hf_trainer.py", "accelerate"),
        ("trl_sft.py", "torchrun"),
        ("trl_dpo.py", "accelerate"),
        ("trl_grpo.py", "accelerate"),
    ],
)
def test_example_trains_data_parallel_at_two_ranks(script, launcher, tmp_path):
    """Both ranks report world_size=2, 4 optimizer steps and the same adapter: with random LoRA init and each rank on
    its own half of the data, only synced gradients (and rank 0's start weights) make the checksums equal. No upstream
    notice (peft's, transformers' and torch's checkpointing warnings) is printed per rank."""
    out, err = _launch(launcher, script, tmp_path)
    finals = {int(rank): (int(world), int(steps), checksum) for rank, world, steps, checksum in FINAL_LINE.findall(out)}
    assert sorted(finals) == [0, 1], out[-3000:]
    assert finals[0] == finals[1] and finals[0][:2] == (2, 4), finals
    if script in ("plain_torch.py", "accelerate_loop.py"):  # their progress lines come from rank 0 only
        assert out.count("step 4 loss ") == 1, out[-3000:]
    notices = NOTICE.findall(err)
    # bitsandbytes prints its kernel notice when peft imports it, before an example's main() can hold it back.
    repeated = {n for n in notices if notices.count(n) > 1 and not n.startswith(BITSANDBYTES_IMPORT_NOTICE)}
    assert not repeated, notices


_TWICE = """
import runpy, sys
import torch.distributed as dist

for name in sys.argv[1:]:
    main = runpy.run_path(name, run_name="example")["main"]
    for _ in range(2):
        if name.endswith("plain_torch.py"):  # BucketedDDP needs a process group: one of one process
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        main()
"""


@pytest.mark.slow
def test_same_adapter_each_run_and_lone_launch_warned(tmp_path):
    """Each unseeded example's main() twice in one process: the second starts from the RNG state the first left, so
    only a seed set before the adapters are drawn gives the same checksum (hf_trainer.py gave another on every run).
    The process is started as a user might, `accelerate launch --cpu --num_processes 2`, which starts one: the
    Trainer's and BucketedAccelerator's warning says so, once."""
    (tmp_path / "twice.py").write_text(_TWICE)
    scripts = [str(ROOT / "examples" / name) for name in ("hf_trainer.py", "accelerate_loop.py", "plain_torch.py")]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    launch = [str(BIN / "accelerate"), "launch", "--cpu", "--num_processes", "2", "twice.py", *scripts]
    run = subprocess.run(
        launch, cwd=tmp_path, env={**env, "PYTHONPATH": PYTHONPATH}, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-6000:])
    finals = FINAL_LINE.findall(run.stdout)
    assert [(rank, world) for rank, world, _, _ in finals] == [("0", "1")] * 6, run.stdout[-3000:]
    checksums = [checksum for *_, checksum in finals]
    assert checksums[0::2] == checksums[1::2], checksums  # each example twice, in turn
    assert run.stderr.count("accelerate launch started this process alone") == 1, run.stderr[-3000:]
    assert "accelerate launch --multi_gpu --num_processes N script.py" in run.stderr


def test_every_example_is_short_and_says_how_to_launch():
    for path in sorted((ROOT / "examples").glob("*.py")):
        text = path.read_text()
        assert len(text.splitlines()) <= 65, f"{path.name}: {len(text.splitlines())} lines"
        assert f"examples/{path.name}" in text.split('"""')[1], f"{path.name}: no launch command in its docstring"
        imported = set(re.findall(r"^from (ddp_ft\S*) import", text, re.MULTILINE))
        assert imported <= {"ddp_ft.integrations", "ddp_ft.ddp", "ddp_ft.distributed", "ddp_ft.embedded"}, imported


def _directives() -> dict[str, str]:
    lines = [line[len("#SBATCH ") :].strip() for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    return {name: value for name, _, value in (line.partition("=") for line in lines)}


def test_sbatch_directives_per_node_signal_requeue():
    directives = _directives()
    assert directives["--ntasks-per-node"] == "1"
    assert directives["--signal"] == "USR1@90"  # no "B:": the step's processes get it, not only the batch shell
    assert "--requeue" in directives and directives["--open-mode"] == "append"


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def _run_sbatch(tmp_path: Path, stop: bool, rc: int, checkpoint: bool = False) -> tuple[int, list[str], str]:
    """The batch script under bash with ``srun`` and ``scontrol`` stubbed: srun records its command line and, as the
    real launch would, appends a stop record when ``stop``, then exits ``rc``; scontrol names two nodes."""
    stubs, out = tmp_path / "bin", tmp_path / "run"
    stubs.mkdir(exist_ok=True)
    out.mkdir(exist_ok=True)
    if checkpoint:
        (out / "latest").write_text("ddp_ft-checkpoint-8\n")
    stop_line = f'echo \'{{"type": "stop", "step": 8}}\' >> {out}/metrics.jsonl' if stop else ""
    _stub(stubs, "srun", f'printf "%s\\n" "$@" > {tmp_path}/srun.args\n{stop_line}\nexit {rc}')
    _stub(
        stubs,
        "scontrol",
        f'if [ "$1" = show ]; then printf "gpu-a07\\ngpu-a08\\n"; else echo "$@" >> {tmp_path}/scontrol.log; fi',
    )
    env = {
        **os.environ,
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu-a[07-08]",
        "SLURM_NNODES": "2",
        "SLURM_GPUS_ON_NODE": "4",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "OUTPUT_DIR": str(out),
    }
    run = subprocess.run(
        ["bash", str(SBATCH), "--max-steps", "16"], env=env, capture_output=True, text=True, timeout=60
    )
    log = tmp_path / "scontrol.log"
    srun_args = (tmp_path / "srun.args").read_text().splitlines()
    return run.returncode, srun_args, log.read_text() if log.exists() else ""


def test_sbatch_torchrun_per_node_rendezvous_on_first(tmp_path):
    rc, srun_args, _ = _run_sbatch(tmp_path, stop=False, rc=0)
    assert rc == 0
    launcher = srun_args.index("torchrun")
    torchrun = torch.distributed.run.get_args_parser().parse_args(srun_args[launcher + 1 :])
    assert (torchrun.nnodes, torchrun.nproc_per_node) == ("2", "4")
    assert (torchrun.rdzv_backend, torchrun.rdzv_endpoint, torchrun.rdzv_id) == ("c10d", "gpu-a07:29500", "4242")
    assert "SIGUSR1" in torchrun.signals_to_handle.split(",")  # else torchrun dies of SLURM's warning signal
    assert torchrun.training_script == "scripts/train.py" and (ROOT / torchrun.training_script).is_file()
    settings = parse_settings(torchrun.training_script_args)
    assert settings.train.output_dir == str(tmp_path / "run") and settings.train.max_steps == 16
    assert settings.train.resume == "" and settings.train.save_every > 0
    assert settings.model.model_name_or_path == "Qwen/Qwen3-4B"


def test_sbatch_resumes_from_the_latest_checkpoint(tmp_path):
    _, srun_args, _ = _run_sbatch(tmp_path, stop=False, rc=0, checkpoint=True)
    script_args = srun_args[srun_args.index("scripts/train.py") + 1 :]
    assert parse_settings(script_args).train.resume == "latest", shlex.join(script_args)


@pytest.mark.parametrize(
    ("stop", "rc", "requeued", "exit_code"),
    [
        (True, 1, True, 0),  # torchrun got SIGUSR1 itself: the ranks saved and exited 0, torchrun exits 1
        (True, 0, True, 0),  # only the ranks got it: torchrun exits 0, but the run is not finished
        (False, 0, False, 0),  # finished
        (False, 1, False, 1),  # a failure: not requeued, the job fails
    ],
)
def test_sbatch_requeues_after_a_stop_only(tmp_path, stop, rc, requeued, exit_code):
    # an earlier attempt's stop record must not count as this attempt's
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"type": "stop", "step": 4}\n')
    code, _, scontrol_log = _run_sbatch(tmp_path, stop=stop, rc=rc)
    assert (scontrol_log == "requeue 4242\n") is requeued, scontrol_log
    assert code == exit_code


@pytest.mark.distributed
@pytest.mark.slow
def test_chat_example_trains_on_messages_at_two_ranks(tmp_path):
    """examples/chat_messages.sh as its header says: the messages format found from the columns, 2 ranks, a
    checkpoint with the adapter, and the format found recorded beside the final adapter."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": PYTHONPATH}
    command = ["bash", str(ROOT / "examples" / "chat_messages.sh"), "--max-steps", "2", "--report-to", "none"]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-6000:]
    assert "data format messages (messages): from its columns" in run.stderr
    assert "2 ranks x micro-batch" in run.stderr
    assert (tmp_path / "runs" / "chat_messages" / "ddp_ft-checkpoint-2" / "adapter").is_dir()
    record = json.loads((tmp_path / "runs" / "chat_messages" / "final" / "ddp_ft_data.json").read_text())
    assert (record["format"], record["shape"]) == ("messages", "chat")  # what generate formats prompts with
