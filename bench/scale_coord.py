"""The instrumented coordinator of ``bench/control_scale.py``: the launcher process of
``checkpointless coordinator`` (``Launcher`` with a ``ClusterSpec``, as ``cli/coordinator.py``'s
``run`` builds it), unchanged, with every store call of its process counted
(``OpCounter``, ``CountingStore``), its loop timed (``TickHook``) and its main thread's stack sampled
(``StackSampler``). It talks to the bench through files in ``<out>/ctl``: ``addr`` (its store),
``stats.json`` (twice a second), ``profile_on`` / ``profile_off`` / ``profile.json`` (the profile
window; ``profile_on`` may name another file: ``profile_failure.json``, from a host's loss to the plan), ``profile_all.json`` (the whole run), ``result.json`` (how it ended).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import threading
import time
import traceback
from collections import Counter, deque
from pathlib import Path
from typing import Any

from bench.scale_sim import NPROC, SPARE_NODES, raise_nofile
from checkpointless.control.auth import job_namespace, read_secret_file


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


_CATEGORIES = ("hb", "node", "events", "gen", "assign", "agents", "job", "report", "fatal", "done", "fault",
               "consistency", "checkpointless")  # fmt: skip
_NODE_KEYS = ("status", "relay", "events", "order")  # node/<host>/<kind>...


class OpCounter:
    """Every store call of the coordinator's process: calls per operation, keys and value bytes per
    key category (the key's first component: ``hb``, ``events``, ``gen``...; a host's keys by their
    kind: ``node status``, ``node relay``, ``node events``, ``node order``), and the seconds the calls
    took, per connection (``main``: the launcher's loop; ``bell``: the report bell's two connections)."""

    def __init__(self, namespace: str) -> None:
        self.ns = namespace
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.keys: Counter[str] = Counter()
        self.bytes_in: Counter[str] = Counter()
        self.bytes_out: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()

    def _category(self, key: Any) -> str:
        k = key.decode() if isinstance(key, bytes) else str(key)
        if k.startswith(self.ns):
            k = k[len(self.ns) :]
        parts = k.split("/", 3)
        if parts[0] == "node" and len(parts) > 2 and parts[2] in _NODE_KEYS:
            return f"node {parts[2]}"
        return parts[0] if parts[0] in _CATEGORIES else "other"

    def record(self, label: str, op: str, args: tuple[Any, ...], result: Any, seconds: float) -> None:
        names = args[0] if args else []
        if isinstance(names, str | bytes):
            names = [names]
        cats = [self._category(k) for k in names] if isinstance(names, list) else []
        out = 0
        if op == "set" and len(args) > 1:
            out = len(args[1])
        elif op == "multi_set" and len(args) > 1:
            out = sum(len(v) for v in args[1])
        inb: list[int] = []
        if op == "get" and result is not None:
            inb = [len(result)]
        elif op == "multi_get" and result is not None:
            inb = [len(v) for v in result]
        with self._lock:
            self.calls[f"{label} {op}"] += 1
            self.seconds[f"{label} {op}"] += seconds
            for i, c in enumerate(cats):
                self.keys[f"{op} {c}"] += 1
                if i < len(inb):
                    self.bytes_in[c] += inb[i]
            if out and cats:
                self.bytes_out[cats[0]] += out

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {
                "calls": dict(self.calls), "keys": dict(self.keys), "bytes_in": dict(self.bytes_in),
                "bytes_out": dict(self.bytes_out), "seconds": dict(self.seconds),
            }  # fmt: skip


class CountingStore:
    """A c10d store whose every call is counted (``OpCounter``); attributes pass through."""

    def __init__(self, inner: Any, counter: OpCounter, label: str) -> None:
        self._inner, self._counter, self._label = inner, counter, label

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name.startswith("_") or not callable(attr):
            return attr
        counter, label = self._counter, self._label

        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            result = None
            try:
                result = attr(*args, **kwargs)
                return result
            finally:
                counter.record(label, name, args, result, time.perf_counter() - t0)

        self.__dict__[name] = call
        return call


class GcTimer:
    """This process's full garbage collections (``gc.callbacks``): how many, and their time."""

    def __init__(self) -> None:
        self.n, self.total_s, self.longest_s = 0, 0.0, 0.0
        self._t0 = 0.0
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        d = time.perf_counter() - self._t0
        self.n, self.total_s, self.longest_s = self.n + 1, self.total_s + d, max(self.longest_s, d)

    def snapshot(self) -> dict[str, Any]:
        return {"full": self.n, "full_s": round(self.total_s, 3), "longest_s": round(self.longest_s, 3)}


class TickHook:
    """An ``on_tick`` callback of the launcher (its main thread, once per loop): times the loop; a
    thread of its own writes the counters to ``ctl/stats.json`` twice a second."""

    def __init__(self, ctl: Path, counter: OpCounter) -> None:
        self.ctl, self.counter = ctl, counter
        self.launcher: Any = None
        self.iters = 0
        self._recent: deque[tuple[float, float]] = deque(maxlen=50_000)  # (wall clock, seconds since last)
        self._lock = threading.Lock()
        self._last: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._stats_loop, name="bench-stats", daemon=True)
        self.gc = GcTimer()

    def start(self) -> None:
        self._thread.start()

    def __call__(self, coord: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if self._last is not None:
                self._recent.append((time.time(), now - self._last))
            self.iters += 1
        self._last = now

    def write(self) -> None:
        with self._lock:
            cutoff = time.time() - 90.0
            recent = [(round(t, 4), round(d, 5)) for t, d in self._recent if t >= cutoff]
            iters = self.iters
        log = self.launcher._log if self.launcher is not None else None
        events = log.recorded if log is not None else 0  # every one, kept or not
        commits = log.commits if log is not None else 0  # the ranks' commits in them (packed per host)
        _write_atomic(self.ctl / "stats.json", json.dumps(
            {"t": time.time(), "iters": iters, "recent": recent, "ops": self.counter.snapshot(), "events": events,
             "commits": commits, "gc": self.gc.snapshot()}
        ))  # fmt: skip

    def _stats_loop(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(Exception):  # a failed write must not end the coordinator
                self.write()


def _mallinfo() -> dict[str, int]:
    """glibc's heap (``mallinfo2``): bytes in use, free inside the heap, and in mmapped blocks."""
    import ctypes

    class _Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Info
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"heap_used": m.uordblks, "heap_free": m.fordblks, "mmapped": m.hblkhd}


def census(root: Any, depth: int = 3, least: int = 50) -> dict[str, int]:
    """The sizes of the containers reachable from ``root``'s attributes (``depth`` levels of objects),
    those holding at least ``least`` items: where a long run's memory goes."""
    out: dict[str, int] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str, left: int) -> None:
        if id(obj) in seen or left < 0:
            return
        seen.add(id(obj))
        attrs = getattr(obj, "__dict__", None)
        if attrs is None:
            return
        for name, value in list(attrs.items()):
            if isinstance(value, dict | list | set | deque | Counter | bytearray | bytes | str):
                with contextlib.suppress(TypeError):
                    if len(value) >= least:
                        out[f"{path}.{name}"] = len(value)
                if isinstance(value, dict) and value and left > 0:
                    first = next(iter(value.values()))
                    if hasattr(first, "__dict__"):
                        walk(first, f"{path}.{name}[*]", left - 1)
            elif hasattr(value, "__dict__") and not isinstance(value, type):
                walk(value, f"{path}.{name}", left - 1)

    walk(root, "launcher", depth)
    return out


class MemoryCensus:
    """Every ``every`` seconds, a line in ``ctl/census.jsonl``: the time, the process's RSS, Python's
    allocated blocks (its small objects), glibc's heap (in use and free: the store's values and
    Python's larger objects), the store's key count and the launcher's large containers (``census``):
    where a long run's memory goes. Its own store connection, not counted."""

    def __init__(self, ctl: Path, launcher: Any, every: float = 10.0) -> None:
        self.ctl, self.launcher, self.every = ctl, launcher, every
        threading.Thread(target=self._loop, name="bench-census", daemon=True).start()

    def _loop(self) -> None:
        store = None
        while True:
            time.sleep(self.every)
            line: dict[str, Any] = {"wall": round(time.time(), 2)}
            with contextlib.suppress(Exception):
                rss = Path("/proc/self/statm").read_text().split()[1]
                line["rss_mb"] = round(int(rss) * 4096 / 2**20, 1)
                line["blocks"] = sys.getallocatedblocks()
                line.update({k: round(v / 2**20, 1) for k, v in _mallinfo().items()})
                if store is None and getattr(self.launcher, "store", None) is not None:
                    from torch.distributed import TCPStore

                    raw = self.launcher.store.raw
                    store = TCPStore(raw.host, raw.port, is_master=False, wait_for_workers=False)
                if store is not None:
                    line["keys"] = store.num_keys()
                line["census"] = census(self.launcher)
            with contextlib.suppress(Exception), (self.ctl / "census.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")


def _short(file: str, line: int, func: str) -> str:
    for marker in ("checkpointless/", "bench/", "site-packages/", "lib/python3"):
        if marker in file:
            file = file[file.index(marker) :]
            break
    return f"{file}:{line}({func})" if line else func


SAMPLE_S = 0.02


class StackSampler:
    """Where the coordinator's main thread spends its wall time: between the bench's
    ``ctl/profile_on`` and ``ctl/profile_off`` a thread samples that thread's Python stack every
    ``SAMPLE_S`` (an in-process sampling profiler: it sees the loop even when one iteration lasts
    minutes, where a profiler started from the loop would not start). A store call is attributed to
    its caller (``store <op> <- caller``); the loop's idle wait shows as ``selectors``."""

    def __init__(self, ctl: Path, thread_id: int) -> None:
        self.ctl, self.tid = ctl, thread_id
        self.window: list[Counter[str]] | None = None  # [inclusive, exclusive, samples] while asked
        self.whole: list[Counter[str]] = [Counter(), Counter(), Counter()]  # since the start
        self._started = time.monotonic()
        threading.Thread(target=self._loop, name="bench-sampler", daemon=True).start()

    def _loop(self) -> None:
        on, off = self.ctl / "profile_on", self.ctl / "profile_off"
        window_start, last_dump, dest = 0.0, time.monotonic(), "profile.json"
        while True:
            time.sleep(SAMPLE_S)
            with contextlib.suppress(Exception):  # a sample lost is no harm
                self._sample()
            now = time.monotonic()
            if self.window is None and on.exists():
                dest = on.read_text().strip() or "profile.json"  # the file the window goes to
                on.unlink()
                self.window, window_start = [Counter(), Counter(), Counter()], now
            elif self.window is not None and off.exists():
                off.unlink()
                _write_atomic(self.ctl / dest, json.dumps(summary_of(self.window, now - window_start)))
                self.window = None
            if now - last_dump > 2.0:  # the whole run's, kept current: a coordinator may not end cleanly
                last_dump = now
                _write_atomic(
                    self.ctl / "profile_all.json", json.dumps(summary_of(self.whole, now - self._started))
                )

    def _sample(self) -> None:
        frame = sys._current_frames().get(self.tid)
        names: list[str] = []
        f = frame
        while f is not None and len(names) < 100:
            code = f.f_code
            names.append(_short(code.co_filename, code.co_firstlineno, code.co_name))
            f = f.f_back
        if not names or frame is None:
            return
        leaf = names[0]
        if names[0].startswith("bench/scale_coord.py") and names[0].endswith("(call)"):
            # blocked in (or making) a store call: named by the first caller outside the store's wrappers
            caller = next((n for n in names[1:] if "control/auth.py" not in n), "?")
            leaf = f"store {frame.f_locals.get('name', '?')} <- {caller}"
        for acc in (self.whole, self.window):
            if acc is None:
                continue
            acc[2]["n"] += 1
            acc[1][leaf] += 1
            for n in set(names):
                acc[0][n] += 1


def summary_of(acc: list[Counter[str]], seconds: float, top: int = 30) -> dict[str, Any]:
    """A sampler's counts as shares of its samples: ``inclusive`` (on the stack), ``exclusive`` (the leaf)."""
    n = max(1, acc[2]["n"])
    return {
        "samples": acc[2]["n"], "window_s": round(seconds, 2),
        "inclusive": [[k, round(v / n, 4)] for k, v in acc[0].most_common(top)],
        "exclusive": [[k, round(v / n, 4)] for k, v in acc[1].most_common(top)],
    }  # fmt: skip


def coordinator_main(a: argparse.Namespace) -> int:
    """The launcher process of ``checkpointless coordinator`` (``cli/coordinator.py``'s ``run``),
    with its store connections counted and its loop timed."""
    import logging

    from checkpointless.config import JobConfig, RecoveryConfig
    from checkpointless.launch import launcher as launcher_mod
    from checkpointless.launch.cluster_spec import ClusterSpec

    raise_nofile()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    secret = read_secret_file(Path(a.secret_file))
    counter = OpCounter(job_namespace(secret))
    real_open, real_tcp = launcher_mod.open_store, launcher_mod.TCPStore

    def tcp_store(*args: Any, **kwargs: Any) -> Any:  # the report bell's connections
        store = real_tcp(*args, **kwargs)
        return store if kwargs.get("is_master") else CountingStore(store, counter, "bell")

    launcher_mod.TCPStore = tcp_store  # type: ignore[misc]
    launcher_mod.open_store = lambda host, port: CountingStore(real_open(host, port), counter, "main")  # type: ignore[assignment]
    base = RecoveryConfig()
    rc = RecoveryConfig(hang_timeout_s=a.hang_timeout,
                        heartbeat_interval_s=min(base.heartbeat_interval_s, a.hang_timeout / 4))  # fmt: skip
    job = JobConfig(workers=a.hosts * NPROC, spares=SPARE_NODES * NPROC, recovery=rc)
    out = Path(a.out)
    ctl = out / "ctl"

    def listening(addr: str) -> None:
        _write_atomic(ctl / "addr", addr)

    spec = ClusterSpec(nodes=a.hosts, nproc_per_node=NPROC, spare_nodes=SPARE_NODES, start_agents=listening,
                       join_timeout_s=a.join_timeout)  # fmt: skip
    hook = TickHook(ctl, counter)
    launcher = launcher_mod.Launcher(job, [], host="127.0.0.1", port=0, out_dir=out / "run", cluster=spec,
                                     secret=secret, on_tick=[hook], timeout_s=a.timeout)  # fmt: skip
    hook.launcher = launcher
    hook.start()
    MemoryCensus(ctl, launcher)
    StackSampler(ctl, threading.main_thread().ident or 0)
    try:
        result = launcher.run()
        outcome = {"ok": result.ok, "error": result.error, "interrupted": result.interrupted,
                   "events": len(result.events)}  # fmt: skip
    except BaseException as e:  # recorded for the bench, then raised
        outcome = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-3000:],
        }
        raise
    finally:
        with contextlib.suppress(Exception):
            hook.write()
        _write_atomic(ctl / "result.json", json.dumps(outcome))
    return 0
