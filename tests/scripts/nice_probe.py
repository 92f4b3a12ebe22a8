"""The demo worker, saying at which nice value the launcher started it and, once its Session is
built (for a spare: after it was assigned a rank), the nice values of all its threads."""

import os
import sys


def _group() -> str:
    # "/autogroup-N nice K"; missing, or empty on kernels without CONFIG_SCHED_AUTOGROUP (CI's)
    try:
        with open("/proc/self/autogroup") as f:
            words = f.read().split()
    except OSError:
        return "none"
    return words[-1] if words else "none"


print(f"nice at start: {os.getpriority(os.PRIO_PROCESS, 0)}, group nice {_group()}", flush=True)

import checkpointless as cl  # noqa: E402
from checkpointless.launch.demo import main  # noqa: E402

_init = cl.Session.__init__


def _init_and_report(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    _init(self, *args, **kwargs)
    nices = sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")})
    print(f"thread nices with a session: {nices}, group nice {_group()}", flush=True)


cl.Session.__init__ = _init_and_report  # type: ignore[method-assign]
raise SystemExit(main(sys.argv[1:]))
