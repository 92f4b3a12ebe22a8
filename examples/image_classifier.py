"""An image classifier with BatchNorm under checkpointless: a complete, deterministic example.

A small ResNet-style CNN (BatchNorm after every convolution, dropout before the head) trains on
a synthetic 10-class image set that is a pure function of (step, data-parallel rank), with a
warm-up + cosine learning-rate schedule and gradient clipping. BatchNorm's running statistics are
buffers every rank updates from its own batch: the session makes them rank 0's at every step, as
``DistributedDataParallel`` does by default, so every replica holds the same state at each commit.

Fault tolerant, with a worker killed and an exception raised:

    checkpointless launch --workers 2 --spares 1 --steps 40 --fault kill:rank=1@step=12 \\
        --fault exception:rank=0@step=25 -- python examples/image_classifier.py --steps 40

or as a single process, for debugging:

    python examples/image_classifier.py --steps 40
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import checkpointless as cl

CLASSES = 10
SIZE = 16  # images are 3 x SIZE x SIZE


def images(step: int, dp_rank: int, dp_size: int, per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as a pure function of (step, rank): a class's fixed pattern, shifted, plus noise."""
    protos = torch.Generator().manual_seed(1234)
    patterns = torch.randn(CLASSES, 3, SIZE, SIZE, generator=protos)
    g = torch.Generator().manual_seed(step * 1_000_003 + dp_rank * 7919 + dp_size)
    labels = torch.randint(0, CLASSES, (per_rank,), generator=g)
    shifts = torch.randint(-2, 3, (per_rank, 2), generator=g)
    x = torch.stack(
        [
            torch.roll(patterns[c], (int(s[0]), int(s[1])), dims=(1, 2))
            for c, s in zip(labels, shifts, strict=True)
        ]
    )
    return x + 0.8 * torch.randn(x.shape, generator=g), labels


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip: nn.Module = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))


class SmallResNet(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(Block(width, width, 1), Block(width, 2 * width, 2))
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(2 * width, CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument(
        "--no-broadcast-buffers", action="store_true",
        help="leave each rank's BatchNorm statistics its own (the job then stops after the first step)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    model = SmallResNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    warmup = max(1, args.steps // 10)
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=warmup),
            torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, args.steps - warmup)),
        ],
        milestones=[warmup],
    )

    session = cl.Session(
        model, optimizer, state={"scheduler": scheduler}, broadcast_buffers=not args.no_broadcast_buffers
    )
    per_rank = args.global_batch // session.dp_size
    model.train()
    for step in session.steps(args.steps):
        with session.attempt() as attempt:
            x, y = images(step, session.dp_rank, session.dp_size, per_rank)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            session.reduce_gradients()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=False)
            session.log(loss=loss, grad_norm=grad_norm, lr=scheduler.get_last_lr()[0])
        if attempt.committed:
            final_loss = loss.item()
    digest = session.finish()
    if session.rank == 0:
        model.eval()
        with torch.no_grad():
            x, y = images(10**6, 0, 1, 256)  # held out: a step no training batch uses
            accuracy = (model(x).argmax(1) == y).float().mean().item()
        print(f"done: {args.steps} steps, final loss {final_loss:.4f}, held-out accuracy {accuracy:.3f}, "
              f"state {digest[:16]}")  # fmt: skip


if __name__ == "__main__":
    main()
