"""Run a training script whose every step lasts at least a given time.

``python paced.py --pause S -- SCRIPT ARGS...``: each ``session.reduce_gradients()`` first sleeps
S seconds, so that a job runs long enough for a process started in a lost one's place to be ready
(a test of a job that grows back) whatever the machine's speed.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time

from checkpointless.session import Session


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pause", type=float, required=True)
    p.add_argument("target", nargs=argparse.REMAINDER)
    args = p.parse_args()
    target = args.target[1:] if args.target[:1] == ["--"] else args.target
    reduce = Session.reduce_gradients

    def paced(self: Session) -> None:
        time.sleep(args.pause)
        reduce(self)

    Session.reduce_gradients = paced  # type: ignore[method-assign]
    sys.argv = target
    runpy.run_path(target[0], run_name="__main__")


if __name__ == "__main__":
    main()
