"""A nanoGPT-style loop, ported: a small character model, gradient accumulation, gradient
clipping, a learning-rate schedule computed from the step, evaluation every few steps, and a
checkpoint of its own to resume from. docs/guide/porting.md shows the changes and why.

    checkpointless launch --workers 2 --spares 1 --fault exception:rank=0@step=9 --out runs/acc \\
        -- python examples/accumulate_eval.py --steps 30
    python examples/accumulate_eval.py --steps 30      # alone
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os

import torch
from torch import nn

import checkpointless as cl

TEXT = ("the quick brown fox jumps over the lazy dog " * 40).encode()
VOCAB, BLOCK = 256, 16


def get_batch(split: str, step: int, rank: int, ranks: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pure function of (split, step, rank): no generator state carried from step to step, so a
    re-executed step and a replacement draw the same windows (nanoGPT draws them from the global RNG)."""
    data = torch.tensor(list(TEXT), dtype=torch.long)
    data = data[: int(0.9 * len(data))] if split == "train" else data[int(0.9 * len(data)) :]
    g = torch.Generator().manual_seed((step * 1_000_003 + rank) * 2 + (split == "val"))
    ix = torch.randint(len(data) - BLOCK - 1, (batch,), generator=g)
    return torch.stack([data[i : i + BLOCK] for i in ix]), torch.stack(
        [data[i + 1 : i + 1 + BLOCK] for i in ix]
    )


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.mix = nn.GRU(32, 32, batch_first=True)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, _ = self.mix(self.emb(x))
        return nn.functional.cross_entropy(self.head(self.drop(h)).flatten(0, 1), y.flatten())


def lr_at(step: int, total: int, base: float = 3e-3, warmup: int = 5) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--checkpoint", default=None, help="resume from it if it exists; written at each eval")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # two runs comparable bit for bit (the replicas start from rank 0's anyway)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr_at(0, a.steps))
    start = 0
    if a.checkpoint and os.path.exists(a.checkpoint):  # every rank, before the session
        ckpt = torch.load(a.checkpoint, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start = int(ckpt["step"])
    session = cl.Session(model, optimizer)
    for step in session.steps(a.steps, start=start):
        with session.attempt() as attempt:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, a.steps)
            for micro in range(a.accumulate):
                # fetched here, not prefetched during the previous step: an attempt must read only
                # what it is given by its step
                x, y = get_batch("train", step * a.accumulate + micro, session.dp_rank, session.dp_size,
                                 a.micro_batch)  # fmt: skip
                last = micro == a.accumulate - 1
                with contextlib.nullcontext() if last else session.no_sync():
                    loss = model(x, y) / a.accumulate
                    loss.backward()
            session.reduce_gradients()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # after the reduction, as with DDP
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            session.log(loss=loss * a.accumulate)
        # evaluation after the commit, on the committed state: a step executed again never evaluates twice
        if attempt.committed and (step + 1) % a.eval_every == 0:
            model.eval()
            with torch.no_grad():
                val = sum(model(*get_batch("val", k, 0, 1, 8)).item() for k in range(4)) / 4
            model.train()
            if session.rank == 0:
                print(f"step {step + 1}: val loss {val:.4f}", flush=True)
                if a.checkpoint:
                    tmp = a.checkpoint + ".tmp"
                    torch.save(
                        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
                        tmp,
                    )
                    os.replace(tmp, a.checkpoint)
    digest = session.finish()
    if session.rank == 0:
        print(f"done {a.steps} steps, state {digest[:16]}")


if __name__ == "__main__":
    main()
