"""Run a training script whose members wait before step N until a file exists.

``python held.py --at N --release FILE -- SCRIPT_OR_-m_MODULE ARGS...``: every member that is
about to start step N (the first time it is yielded) waits, outside any attempt, until FILE
exists (60 s at most, then goes on). A test forces an interleaving with it: the coordinator
acts while every member is known to be mid-run, then the test creates FILE to let them go.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from checkpointless.session import Session


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--at", type=int, required=True)
    p.add_argument("--release", type=Path, required=True)
    p.add_argument("target", nargs=argparse.REMAINDER)
    args = p.parse_args()
    target = args.target[1:] if args.target[:1] == ["--"] else args.target
    steps = Session.steps
    held = False

    def held_steps(self: Session, total: int, *, start: int = 0) -> Iterator[int]:
        nonlocal held
        for step in steps(self, total, start=start):
            if step == args.at and not held:
                held = True
                deadline = time.monotonic() + 60.0
                while not args.release.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
            yield step

    Session.steps = held_steps  # type: ignore[method-assign]
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = target
        runpy.run_path(target[0], run_name="__main__")


if __name__ == "__main__":
    main()
