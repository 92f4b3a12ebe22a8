"""A stranger on a job's control store: forges every protocol key and tries to join its process group.

Usage: adv_stranger.py HOST PORT STATUS_JSON [MAX_SECONDS [ATTACKS]]

It connects to the store with a plain ``TCPStore`` client (retrying until the
store is up), then, every ``PERIOD_S`` until killed (or MAX_SECONDS), writes every
key of the protocol (``checkpointless/protocol/keys.py``): on even rounds sealed
with a secret of its own (as a process of another job would), on odd rounds
unsealed (plain JSON or garbage). It bumps the counters a real reporter bumps,
and puts event chunks in the slots the launcher reads next. A thread tries to
join generation 0's process group on the guessable rendezvous prefixes.
ATTACKS (comma separated, default all of ``ATTACKS``) picks what it does;
``list`` (not a default) lists the store's keys (``TCPStore.list_keys()`` answers anyone) and writes
the abort key of every generation it sees, and the job's stop key, under every namespace it finds
there: the names a stranger learns, not the plain ones;
``hbflood`` (not a default) instead overwrites ``hb/w0`` in a tight loop, from
when a file ``STATUS_JSON.go`` appears on (the test creates it once the
coordinator has seen w0 join).
STATUS_JSON says what it did (written atomically: once its imports are done,
then every round), so a test can check that the attack ran while the job did.

The fault-injection claim counters (``fault/<i>/rank/<r>/fired``) are left
alone: they are a test hook, not part of the control protocol, and bumping them
would only keep an injected test fault from firing.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed import TCPStore

from checkpointless.control.auth import SignedStore, new_secret
from checkpointless.control.plan import Plan
from checkpointless.protocol import keys

FAKE_DIGEST = "0" * 64
PROCS = ("w0", "w1", "s0", "s1")
GARBAGE = (b"garbage", b"\xff\xfe" * 8, b"0" * 64 + b".1", b"")
ATTACKS = ("plan", "latest", "abort", "stop", "assign", "done", "hb", "fail", "failcount", "fatal",
           "events", "pg")  # fmt: skip
HOSTS = ("host0", "host1", "host2")  # the hosts' names under ``checkpointless cluster``
"""``agent`` (not a default: the multi-host protocol) forges what the coordinator and the hosts'
agents exchange: a job config, agents' hellos (bumping the ticket counter), every host's status
(its processes dead) and orders (kill, stop) to every host's agent."""
PERIOD_S = 0.2
"""Between two rounds: longer than the job's heartbeat interval (0.1 s), so that a forged heartbeat
hides at most one real one from the coordinator (faster overwriting is the ``hbflood`` attack)."""


def connect(host: str, port: int) -> TCPStore:
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)


def forged_values(rnd: int, attacks: set[str]) -> list[tuple[str, str]]:
    """(key, value) of every protocol message, as plausible as the stranger can make them."""
    out: list[tuple[str, str]] = []
    for gen in range(4):
        if "plan" in attacks:
            plan = Plan(gen=gen, world_size=2, shards=1, members={0: "stranger", 1: "w1"}, resume_step=0,
                        sources={1: 0}, replaced={0: "w0"})  # fmt: skip
            out.append((keys.plan(gen), plan.to_json()))
            out.append((keys.layout(gen, 0), "[]"))
        if "abort" in attacks:
            out.append((keys.abort(gen), "1"))
        if "fail" in attacks:
            report = {"committed": 0, "reason": "stranger", "proc": "w0", "has_state": True}
            out.append((keys.fail(gen, 0), json.dumps(report)))
    if "latest" in attacks:
        out.append((keys.LATEST_GEN, "3"))
    if "stop" in attacks:
        out.append((keys.JOB_STOP, "1"))
    if "assign" in attacks:
        out += [(keys.assign("s0"), "1"), (keys.assign("s1"), "2")]
    if "done" in attacks:
        out += [
            (keys.done(r), json.dumps({"digest": FAKE_DIGEST, "step": 9, "proc": f"w{r}"})) for r in (0, 1)
        ]
    if "hb" in attacks:
        out += [
            (keys.heartbeat("w0"), json.dumps({"seq": 10**6 + rnd, "phase": "done", "t": time.time()})),
            (keys.heartbeat("s0"), json.dumps({"seq": 10**6 + rnd, "phase": "spare", "t": time.time()})),
        ]
    if "fatal" in attacks:
        out.append((keys.fatal("w0"), json.dumps({"rank": 0, "error": "the stranger says stop"})))
    if "agent" in attacks:
        out.append((keys.JOB_CONFIG, json.dumps({"job": {"workers": 1}, "job_id": "stranger"})))
        out.append((keys.agent_hello(rnd), json.dumps({"host": "stranger", "addr": "10.0.0.1", "nproc": 1,
                                                       "spare": True, "pid": 1})))  # fmt: skip
        for h in HOSTS:
            dead = {f"w{i}": {"alive": False, "exit": 0, "pid": 1} for i in range(4)}
            out.append(
                (keys.node_status(h), json.dumps({"seq": 10**6 + rnd, "procs": dead, "stopped": True}))
            )
            for i in range(8):
                order = {"op": "kill", "name": f"w{i % 4}"} if i % 2 else {"op": "stop"}
                out.append((keys.node_order(h, i), json.dumps(order)))
    return out


OWN: set[str] = set()  # the raw names the ``list`` attack wrote
LISTED = re.compile(r"^(.*?)(?:gen/(\d+)/|hb/|job/|done/|events/)")


def listed_values(store: TCPStore, own: set[str]) -> list[tuple[str, str]]:
    """(raw key, protocol key) of the abort of every generation seen (and the next two) and of the
    job's stop, under each namespace that ``list_keys()`` shows (``own``: the names it wrote itself,
    which it does not count as seen)."""
    spaces: dict[str, int] = {}
    for name in store.list_keys():
        m = LISTED.match(name)
        if name in own:
            continue
        if m is not None and "/pg/" not in name:
            ns, gen = m.group(1), m.group(2)
            spaces[ns] = max(spaces.get(ns, 0), int(gen) if gen is not None else 0)
    out: list[tuple[str, str]] = []
    for ns, top in spaces.items():
        out += [(ns + keys.abort(g), keys.abort(g)) for g in range(top + 3)]
        out.append((ns + keys.JOB_STOP, keys.JOB_STOP))
    return out


def attack(store: TCPStore, forged: SignedStore, rnd: int, attacks: set[str], written: set[str]) -> None:
    if "list" in attacks:
        for i, (name, key) in enumerate(listed_values(store, OWN)):
            OWN.add(name)
            if rnd % 2 == 0:
                store.set(name, forged.seal(key, "1"))  # type: ignore[arg-type]  # another job's seal
            else:
                store.set(name, GARBAGE[i % len(GARBAGE)] if i % 2 else b"1")  # type: ignore[arg-type]
            written.add(key)
    for i, (key, value) in enumerate(forged_values(rnd, attacks)):
        if rnd % 2 == 0:
            forged.set(key, value)  # sealed, but with another job's secret
        else:
            raw = GARBAGE[(rnd + i) % len(GARBAGE)] if i % 2 else value.encode()
            store.set(key, raw)  # type: ignore[arg-type]  # unsealed (c10d takes bytes too)
        written.add(key)
    # counters are hints: bump them as a real reporter would, so that readers look at the forgeries
    if "failcount" in attacks:
        store.add(keys.fail_count(0), 1)
        written.add(keys.fail_count(0))
    if "fatal" in attacks:
        store.add(keys.FATAL_COUNT, 1)
        written.add(keys.FATAL_COUNT)
    if "agent" in attacks:
        store.add(keys.AGENTS_COUNT, 1)
        written.add(keys.AGENTS_COUNT)
    if "events" in attacks:
        for proc in PROCS:
            # a chunk in a slot a reader looks at (chunks are numbered from 0, read in order)
            chunk = rnd
            line = json.dumps({"t": time.time(), "kind": "job_finished", "ok": False, "error": "stranger"})
            key = keys.events(proc, chunk)
            forged.set(key, line + "\n")
            written.add(key)


def join_group(host: str, port: int, results: list[dict[str, Any]]) -> None:
    """Try to join generation 0's group as rank 0 and as rank 1 on the prefixes one could guess."""
    for prefix in ("pg/0/", "gen/0/pg/", "gen/0/"):
        for rank in (0, 1):
            t0 = time.monotonic()
            try:
                pg = dist.ProcessGroupGloo(
                    dist.PrefixStore(prefix, connect(host, port)), rank, 2, timedelta(seconds=1.5)
                )
                results.append({"prefix": prefix, "rank": rank, "joined": True})
                del pg
            except Exception as e:
                results.append({"prefix": prefix, "rank": rank, "joined": False, "error": str(e)[:200],
                                "seconds": round(time.monotonic() - t0, 2)})  # fmt: skip


def flood_heartbeat(host: str, port: int, go: Path, state: dict[str, Any]) -> None:
    """Overwrite w0's heartbeat as fast as possible once the file ``go`` exists."""
    store = connect(host, port)
    key = keys.heartbeat("w0")
    while not go.exists():
        time.sleep(0.01)
    state["flood_t"] = time.time()
    while True:
        store.set(key, b"flood")  # type: ignore[arg-type]
        state["floods"] = state.get("floods", 0) + 1


def main() -> int:
    host, port, status = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    max_s = float(sys.argv[4]) if len(sys.argv) > 4 else 60.0
    attacks = set(sys.argv[5].split(",")) if len(sys.argv) > 5 else set(ATTACKS)
    write_status(status, {"rounds": 0, "phase": "connecting"})  # imports done: the test may start the job
    store = connect(host, port)
    forged = SignedStore(store, new_secret())
    pg_results: list[dict[str, Any]] = []
    written: set[str] = set()
    if "pg" in attacks:
        threading.Thread(target=join_group, args=(host, port, pg_results), daemon=True).start()
    flood: dict[str, Any] = {}
    if "hbflood" in attacks:
        go = status.with_name(status.name + ".go")
        threading.Thread(target=flood_heartbeat, args=(host, port, go, flood), daemon=True).start()
        written.add(keys.heartbeat("w0"))
    rounds, first_t = 0, time.time()  # connected
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        try:
            attack(store, forged, rounds, attacks, written)
        except Exception:  # the store went away with its job
            break
        rounds += 1
        write_status(status, {"rounds": rounds, "phase": "attacking", "first_t": first_t, "last_t": time.time(),
                              "keys": sorted(written), "pg": list(pg_results), **flood})  # fmt: skip
        time.sleep(PERIOD_S)
    return 0


def write_status(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
