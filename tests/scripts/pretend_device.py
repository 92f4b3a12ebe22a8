"""A training script on the pretend accelerator (``tests/devicefake.py``): its data plane is a
``PlaneGroup`` that refuses CPU tensors as NCCL does, its control plane a gloo group that refuses
device tensors.

Usage: pretend_device.py STEPS (``PLANES_OUT``: a directory for each process's call counts and
refusals). A model with BatchNorm (buffers broadcast every step) and AdamW (state on the device, its
step counts on the CPU, as on a GPU), its batches moved to ``session.device``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import devicefake


def main() -> None:
    import checkpointless as cl
    import checkpointless.formation
    import checkpointless.session

    steps = int(sys.argv[1])
    out = os.environ["PLANES_OUT"]
    torch.set_num_threads(1)
    checkpointless.formation.Group = devicefake.PlaneGroup  # type: ignore[misc]
    checkpointless.session.local_device = lambda: devicefake.PRETEND  # session.device
    with devicefake.PretendMode():
        torch.manual_seed(0)
        model = devicefake.on_pretend(
            torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
        )
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        session = cl.Session(model, opt, seed=1)
        assert session.device == devicefake.PRETEND
        for step in session.steps(steps):
            with session.attempt():
                g = torch.Generator().manual_seed(step * 10 + session.dp_rank)
                x = torch.randn(4, 6, generator=g).to(session.device)
                loss = (model(x) + 0.01 * torch.randn(4, 1, device=session.device)).pow(2).mean()
                loss.backward()
                session.reduce_gradients()
                opt.step()
                opt.zero_grad()
                session.log(loss=loss)
        session.finish()
    devicefake.dump_calls(os.path.join(out, f"{os.environ['CHECKPOINTLESS_PROC']}.json"))


if __name__ == "__main__":
    main()
