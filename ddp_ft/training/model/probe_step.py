"""The step ``--micro-batch auto`` measures: forward and backward as a loop micro-step runs them."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ...distributed import DistInfo
from .precision import Precision


class ProbeStep:
    """Forward and backward of full-length random sequences, as a loop micro-step runs them.

    As a context, it restores the gradients, random generators and train mode.
    """

    def __init__(self, model, trainable, seq_len: int, info: DistInfo, precision: Precision | None) -> None:
        self.model, self.trainable, self.seq_len, self.info, self.precision = model, trainable, seq_len, info, precision
        self.vocab = model.get_input_embeddings().num_embeddings

    def __enter__(self) -> ProbeStep:
        self.saved_grads = [p.grad for p in self.trainable]
        self.was_training = self.model.training
        cuda = [self.info.device] if self.info.device.type == "cuda" else []
        self.rng = torch.random.fork_rng(devices=cuda)
        self.rng.__enter__()
        self.model.train()
        return self

    def __exit__(self, *exc) -> None:
        for p, grad in zip(self.trainable, self.saved_grads, strict=True):
            p.grad = grad
        self.model.train(self.was_training)
        self.rng.__exit__(*exc)
        if self.info.device.type == "cuda":  # peaks restart at training
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.info.device)

    def release(self) -> None:
        for p in self.trainable:
            p.grad = None

    def run(self, micro_batch: int) -> None:
        # Zero gradients in place, as in accumulation, so the peak counts them.
        for p in self.trainable:
            p.grad = torch.zeros_like(p)
        device = self.info.device
        generator = torch.Generator().manual_seed(micro_batch)  # the global generators stay untouched
        ids = torch.randint(0, self.vocab, (micro_batch, self.seq_len), generator=generator).to(device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        items = torch.tensor(float(micro_batch * (self.seq_len - 1)), device=device)
        autocast = self.precision.autocast_context() if self.precision is not None else nullcontext()
        with autocast:
            loss = self.model(**batch, num_items_in_batch=items).loss
            (loss * self.info.world_size).backward()
        self.release()
