"""Which device a process trains on, known when it starts.

The launcher gives every process it starts, worker or spare, its *slot* on the host
(``CHECKPOINTLESS_LOCAL_INDEX``, and ``LOCAL_RANK`` as torchrun does): workers ``w0..w{N-1}`` hold
slots ``0..N-1``, spares the next ones, and a process started later (a refilled spare) takes the
lowest slot no live process holds, so a replacement spare lands on the GPU its dead predecessor
freed. The slot is the process's, not its rank's: a spare knows its device before it is given a
rank, and builds its model there while it waits.

A CUDA job (``JobConfig.device`` ``cuda``, the default with ``backend: nccl``) trains on
``cuda:<slot mod the number of visible GPUs>``. More slots than GPUs share them: fine over gloo
(the single-GPU check runs several ranks on one GPU), refused by NCCL (two ranks of one NCCL group
on one GPU), so an NCCL job needs a GPU per worker and per spare on each host.
"""

from __future__ import annotations

import os

import torch

from checkpointless.config import JobConfig
from checkpointless.errors import UsageError
from checkpointless.protocol.env import ENV_CONFIG, ENV_LOCAL_INDEX


def local_index() -> int:
    """This process's slot on its host: ``CHECKPOINTLESS_LOCAL_INDEX``, else ``LOCAL_RANK``, else 0."""
    for name in (ENV_LOCAL_INDEX, "LOCAL_RANK"):
        text = os.environ.get(name)
        if text is not None:
            try:
                index = int(text)
            except ValueError:
                raise UsageError(f"{name}={text!r} is not a slot number (0, 1, ...)") from None
            if index < 0:
                raise UsageError(f"{name}={index} must be >= 0")
            return index
    return 0


def device_for(device_type: str, index: int | None = None) -> torch.device:
    """The device of slot ``index`` (this process's by default) for a job on ``device_type``."""
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type != "cuda":
        raise UsageError(f"device must be cpu or cuda, got {device_type!r}")
    if not torch.cuda.is_available():
        raise UsageError(
            "the job trains on CUDA (backend nccl or device cuda) but this process sees no CUDA device "
            f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    slot = local_index() if index is None else index
    return torch.device("cuda", slot % torch.cuda.device_count())


def local_device() -> torch.device:
    """The device this process trains on (``Session.device``), before any ``Session`` exists: build
    the model there, then hand it to the session. ``cpu`` without a launcher."""
    text = os.environ.get(ENV_CONFIG)
    if text is None:
        return torch.device("cpu")
    return device_for(JobConfig.from_json(text).device_type)
