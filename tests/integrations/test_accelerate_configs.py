"""Every shipped accelerate config parses as Accelerate's own config and shows its launch command."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig

from ddp_ft.distributed.launch import launched_alone

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "accelerate_configs").glob("*.yaml"))


def test_the_four_launch_setups_are_shipped():
    assert {p.stem for p in CONFIGS} == {"single", "2gpu", "2cpu_gloo", "multinode"}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_loads_and_header_shows_launch_command(path):
    config = ClusterConfig.from_yaml_file(str(path))
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any(f"accelerate launch --config_file accelerate_configs/{path.name}" in line for line in header)
    expected_processes = {"single": 1, "2gpu": 2, "2cpu_gloo": 2, "multinode": 4}[path.stem]
    assert config.num_processes == expected_processes
    if path.stem == "multinode":
        assert config.num_machines == 2


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
def test_single_process_trace_told_from_real_launches(environ, alone):
    assert (launched_alone(environ) is not None) == alone
