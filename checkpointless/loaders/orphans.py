"""A loader's worker processes die with the training process that made them.

``StepLoader`` starts its workers from a ``forkserver`` (the training process runs threads, so it
must not ``fork``). A worker's parent is then the fork server, not the training process, so
torch's own check (the worker exits once its parent is gone) watches the wrong process, and the
fork server outlived a SIGKILLed rank too: both stayed behind after a kill fault. So the fork
server preloads ``_forkserver_preload`` (``PR_SET_PDEATHSIG`` towards the training process that
started it) and each worker runs ``die_with_parent`` first (towards the fork server). The kernel
sends the signal when the *thread* that started the process ends: the loader is iterated from the
training loop's thread, which lives as long as the process.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(*_: object) -> None:
    """SIGKILL this process when its parent dies; exit now if it already has (a ``worker_init_fn``)."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return  # not Linux: torch's own check is all there is
    if os.getppid() != parent or parent == 1:
        os._exit(0)  # the parent died before the request took effect
