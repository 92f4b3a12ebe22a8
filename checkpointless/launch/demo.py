"""``checkpointless demo``: a small GPT trained by N workers and S hot spares through real faults.

This module is both the launcher side (``run_demo``) and the training script
that every worker and spare runs (``python -m checkpointless.launch.demo --worker``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch

from checkpointless.corpus.synthetic import SyntheticTokens
from checkpointless.protocol.vocab import Event


@dataclass(kw_only=True, slots=True)
class DemoModel:
    """What the demo trains (shared by launcher and workers, passed as JSON)."""

    steps: int = 60
    seed: int = 0
    vocab_size: int = 64
    seq_len: int = 64
    d_model: int = 128
    n_layer: int = 2
    n_head: int = 4
    global_batch: int = 16
    lr: float = 1e-3
    eval_every: int = 20


def build(
    spec: DemoModel, device: torch.device | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer, SyntheticTokens]:
    """(model, optimizer, training data) of the demo, identical in every process (and baseline);
    the model on ``device`` (``checkpointless.local_device()``; the CPU by default)."""
    from checkpointless.models.tiny_gpt import GPTConfig, TinyGPT

    torch.set_num_threads(1)
    torch.manual_seed(spec.seed)
    cfg = GPTConfig(
        vocab_size=spec.vocab_size, seq_len=spec.seq_len, d_model=spec.d_model,
        n_layer=spec.n_layer, n_head=spec.n_head,
    )  # fmt: skip
    model = TinyGPT(cfg).to(device or torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    data = SyntheticTokens(
        seed=spec.seed, vocab_size=spec.vocab_size, seq_len=spec.seq_len, global_batch=spec.global_batch
    )
    return model, optimizer, data


def train(spec: DemoModel) -> None:
    """The training script every worker and spare runs: a plain loop with checkpointless."""
    import checkpointless as cl

    device = cl.local_device()  # session.device: this process's GPU on a CUDA job, cpu otherwise
    model, optimizer, data = build(spec, device)
    heldout = SyntheticTokens(
        seed=spec.seed + 1, vocab_size=spec.vocab_size, seq_len=spec.seq_len, global_batch=8
    )

    session = cl.Session(model, optimizer, seed=spec.seed)  # a spare waits here for a rank
    for step in session.steps(spec.steps):
        with session.attempt() as attempt:
            tokens = 0
            for _share in session.shares():  # one per replica, or more once the job shrank
                inputs, targets = data.batch(step, session.dp_rank, session.dp_size)
                inputs, targets = inputs.to(session.device), targets.to(session.device)
                loss = model(inputs, targets)
                loss.backward()
                session.log(loss=loss.item())
                tokens += inputs.numel()
            session.reduce_gradients()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            session.log(tokens=tokens)
        if not attempt.committed:
            continue  # the step failed and was recovered: steps() yields it again
        if session.rank == 0 and spec.eval_every and (step + 1) % spec.eval_every == 0:
            model.eval()
            with torch.no_grad():
                x, y = heldout.batch(0, 0, 1)
                session.emit(Event.EVAL, heldout_loss=model(x.to(device), y.to(device)).item())
            model.train()
    session.finish()


def default_faults(workers: int, steps: int) -> list[str]:
    """Kill a worker a third of the way in and hang another at two thirds."""
    k, h = steps // 3, (2 * steps) // 3
    return [f"kill:rank={min(1, workers - 1)}@step={k}", f"hang:rank=0@step={h}"]


def main(argv: list[str] | None = None) -> int:
    """Worker entry: ``python -m checkpointless.launch.demo --worker JSON``."""
    p = argparse.ArgumentParser(prog="python -m checkpointless.launch.demo")
    p.add_argument("--worker", required=True, help="DemoModel as JSON")
    args = p.parse_args(argv)
    train(DemoModel(**json.loads(args.worker)))
    return 0


def worker_command(spec: DemoModel) -> list[str]:
    return [sys.executable, "-m", "checkpointless.launch.demo", "--worker", json.dumps(asdict(spec))]


if __name__ == "__main__":
    raise SystemExit(main())
