"""A process that holds a ``ControlClient`` and does nothing else (the heartbeat lease tests).

Usage: heartbeat_child.py ADDR LEASE_S INTERVAL_S SECRET_HEX [RELAY] (a test's secret; RELAY: the
address of a host agent's relay store, ``launch/relay.py``). It prints ``ready``, then answers each ``pub KEY`` line on stdin by publishing
KEY on the main connection and printing ``ok KEY`` (or ``error ...``), and each ``gil S`` line by
holding the GIL for about S seconds in native code (one ``sum`` over a range: what a full garbage
collection does to the heartbeat thread) and printing ``ok gil``.
"""

from __future__ import annotations

import sys
import time

from checkpointless.control.client import ControlClient


def main() -> None:
    addr, lease, interval, secret = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    relay = sys.argv[5] if len(sys.argv) > 5 else None
    client = ControlClient(
        addr, "w0", bytes.fromhex(secret), heartbeat_interval=interval, lease_s=lease, relay=relay
    )
    print("ready", flush=True)
    t = time.perf_counter()
    sum(range(1_000_000))
    per_item = (time.perf_counter() - t) / 1_000_000
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["gil"]:
            sum(range(int(float(words[1]) / per_item)))  # one C call: the GIL is never released
            print("ok gil", flush=True)
        if words[:1] == ["pub"]:
            try:
                client.publish(words[1], "1")
                print(f"ok {words[1]}", flush=True)
            except Exception as e:  # the test reads the reason
                print(f"error {type(e).__name__}: {e}".splitlines()[0], flush=True)


if __name__ == "__main__":
    main()
