"""Transfer rate into a recovering spare, as a recovery sees it (not a microbenchmark).

Runs the demo (2 workers + 1 spare, d_model 512, 4 layers: 152.5 MB of model and AdamW state),
kills rank 1 at step 6, and reads the ``transfer_ended`` event: bytes / seconds into the spare's
own tensors, repetition by repetition (``seconds`` from the header's arrival, as ``bench/transfer.py``
times after a barrier; ``waited_s``, the spare's wait for the source to begin, is printed beside it).

Usage: ``OMP_NUM_THREADS=1 python -m bench.spare_transfer [--reps 3]`` (prints one line a repetition
and the median; run it on two trees to compare, e.g. with and without a change).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from checkpointless.protocol.vocab import Event


def once(out: Path) -> float:
    cmd = [sys.executable, "-m", "checkpointless", "demo", "--workers", "2", "--spares", "1", "--steps", "12",
           "--d-model", "512", "--layers", "4", "--global-batch", "4", "--fault", "kill:rank=1@step=6",
           "--quiet", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    for line in (out / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["kind"] == Event.TRANSFER_ENDED:
            rate = e["bytes"] / e["seconds"] / 1e9
            print(f"{e['bytes'] / 1e6:.1f} MB in {e['seconds']:.3f} s = {rate:.2f} GB/s "
                  f"(after waiting {e.get('waited_s', 0.0):.3f} s for the source)", flush=True)  # fmt: skip
            return float(rate)
    raise SystemExit("no transfer_ended event: the recovery did not transfer state")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rates = [once(Path(tmp) / f"run{i}") for i in range(args.reps)]
    print(f"median {statistics.median(rates):.2f} GB/s over {len(rates)} repetitions")


if __name__ == "__main__":
    main()
