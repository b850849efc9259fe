"""Small reference models for the BucketedDDP tests."""

import torch
from torch import nn


class Net(nn.Module):
    """Layers of different sizes, a frozen layer in the middle, a buffer; optionally an unused branch."""

    def __init__(self, unused_branch: bool = False, hidden: int = 32):
        super().__init__()
        self.embed = nn.Linear(16, hidden)
        self.frozen = nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)
        self.blocks = nn.Sequential(nn.Linear(hidden, 64), nn.Tanh(), nn.Linear(64, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 4)
        self.register_buffer("scale", torch.ones(hidden))
        self.unused = nn.Linear(hidden, hidden) if unused_branch else None

    def forward(self, x, use_unused: bool = False):
        h = torch.tanh(self.frozen(self.embed(x))) * self.scale
        if use_unused:
            h = h + self.unused(h)
        return self.head(self.blocks(h))


def make_batch(step: int, global_batch: int = 8):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(global_batch, 16, generator=g), torch.randn(global_batch, 4, generator=g)


def local_slice(rank: int, world_size: int, global_batch: int = 8) -> slice:
    per_rank = global_batch // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)
