"""Every shipped accelerate config parses as Accelerate's own config and shows its launch command."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig

from ddp_ft.integrations.launch import launched_alone

from .dist_harness import PYTHONPATH

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "accelerate_configs").glob("*.yaml"))


def test_the_four_launch_setups_are_shipped():
    assert {p.stem for p in CONFIGS} == {"single", "2gpu", "2cpu_gloo", "multinode"}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_loads_in_accelerate_and_its_header_shows_the_launch_command(path):
    config = ClusterConfig.from_yaml_file(str(path))
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any(f"accelerate launch --config_file accelerate_configs/{path.name}" in line for line in header)
    expected_processes = {"single": 1, "2gpu": 2, "2cpu_gloo": 2, "multinode": 4}[path.stem]
    assert config.num_processes == expected_processes
    if path.stem == "multinode":
        assert config.num_machines == 2


_MY_SCRIPT = """
from ddp_ft.integrations import BucketedAccelerator

accelerator = BucketedAccelerator(cpu=True)
BucketedAccelerator(cpu=True)  # a second one (the Trainer adopts one per train()): still one warning
print(f"rank {accelerator.process_index} of {accelerator.num_processes}")
"""


def test_accelerate_launch_cpu_with_two_processes_starts_one_and_bucketed_accelerator_says_so(tmp_path):
    """Accelerate 1.15's --cpu takes its single-process launcher whatever --num_processes says, silently; the trace it
    leaves (MASTER_PORT exported, no world size) makes BucketedAccelerator warn once, naming the launch that works."""
    (tmp_path / "mine.py").write_text(_MY_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = PYTHONPATH
    launch = [str(Path(sys.executable).parent / "accelerate"), "launch", "--cpu", "--num_processes", "2", "mine.py"]
    run = subprocess.run(launch, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n").count("rank 0 of 1") == 1 and "rank 1" not in run.stdout, run.stdout
    assert run.stderr.count("accelerate launch started this process alone") == 1, run.stderr[-3000:]
    assert "accelerate launch --multi_gpu --num_processes N script.py" in run.stderr


@pytest.mark.parametrize(
    ("environ", "alone"),
    [
        ({"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, True),  # --cpu, N > 1
        ({"ACCELERATE_USE_CPU": "True"}, False),  # --cpu with one process: no rendezvous exported
        ({"ACCELERATE_USE_CPU": "False", "MASTER_PORT": "29500", "PMI_SIZE": "2"}, False),  # mpirun: a world of 2
        ({"MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "0"}, False),  # torchrun / the multi-GPU launcher
        ({}, False),  # python script.py
    ],
)
def test_the_single_process_launchers_trace_is_told_from_real_launches(environ, alone):
    assert (launched_alone(environ) is not None) == alone
