"""TRL's trainers beyond SFT, and any Trainer subclass, with BucketedDDP: ``bucketed`` and the named classes."""

import subprocess
import sys

import pytest

from ddp_ft.integrations import TRL_TRAINERS, BucketedTrainer, bucketed


def test_named_classes_lazy_and_bucketed_trl_classes():
    code = "import sys, ddp_ft.integrations; assert 'trl' not in sys.modules, 'trl imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    import trl

    import ddp_ft.integrations as integrations

    for name, trl_name in TRL_TRAINERS.items():
        made = getattr(integrations, name)
        assert made is bucketed(getattr(trl, trl_name)) and made.__name__ == name
        assert made.__mro__[1] is BucketedTrainer and issubclass(made, getattr(trl, trl_name))


def test_bucketed_takes_subclass_once_refuses_rest():
    from transformers import Trainer

    class MyTrainer(Trainer):
        pass

    made = bucketed(MyTrainer)
    assert made is bucketed(MyTrainer) and bucketed(made) is made and made.__name__ == "BucketedMyTrainer"
    assert bucketed(BucketedTrainer) is BucketedTrainer
    with pytest.raises(TypeError, match=r"bucketed\(<class 'int'>\): not a subclass of transformers.Trainer"):
        bucketed(int)


ASYNC = [("async_grpo", "AsyncGRPOTrainer"), ("async_distillation", "AsyncDistillationTrainer")]


@pytest.mark.parametrize("module, name", ASYNC)
def test_rollout_worker_trainers_refused_by_name(module, name):
    import importlib

    trainer = getattr(importlib.import_module(f"trl.experimental.{module}"), name)

    class Mine(trainer):
        pass

    for cls in (trainer, Mine):
        with pytest.raises(
            TypeError, match=rf"bucketed\({cls.__name__}\): trl\.experimental\..*\.{name} .*rollout worker.*stock class"
        ):
            bucketed(cls)
