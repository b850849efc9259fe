"""Run under `accelerate launch` by tests/integrations/test_accelerate_launch.py: BucketedAccelerator on 2 CPU processes."""

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate.utils import DistributedType  # noqa: E402

from ddp_ft.ddp import BucketedDDP  # noqa: E402
from ddp_ft.integrations import BucketedAccelerator  # noqa: E402
from tests.helpers.dist_harness import gather_tensors  # noqa: E402
from tests.helpers.models import Net, local_slice, make_batch  # noqa: E402


def main() -> None:
    accelerator = BucketedAccelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.distributed_type
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(model, BucketedDDP), f"prepared model is a {type(model).__name__}, not BucketedDDP"
    rank, world = accelerator.process_index, accelerator.num_processes
    local = local_slice(rank, world)
    buckets = len(model.bucket_sizes)
    for step in range(6):
        x, y = make_batch(step)
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x[local]), y[local])
            accelerator.backward(loss)
            calls = model.last_comm_stats().allreduce_calls
            grads = [p.grad for p in model.module.parameters() if p.requires_grad]
            copies = gather_tensors(grads)
            same = all(torch.equal(a, b) for a, b in zip(copies[0], copies[1], strict=True))
            if accelerator.sync_gradients:
                assert calls == buckets and same, (step, calls, same)
            else:
                assert calls == 0 and not same, (step, calls, same)
            optimizer.step()
            optimizer.zero_grad()
    params = [p for p in model.module.parameters() if p.requires_grad]
    copies = gather_tensors(params)
    assert all(torch.equal(a, b) for a, b in zip(copies[0], copies[1], strict=True)), "parameters diverged"
    assert accelerator.unwrap_model(model) is model.module
    state = accelerator.get_state_dict(model)
    assert state and not any(k.startswith("module.") for k in state), list(state)[:3]
    with tempfile.TemporaryDirectory() as out:
        accelerator.save_model(model, out)
        accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.is_main_process:
        print("BUCKETED_ACCELERATOR_OK")


if __name__ == "__main__":
    main()
