"""``checkpointless agent``: one host of a job on several hosts.

The agent joins the coordinator's job (``launch/remote.py`` has the protocol), then starts,
watches and stops its host's processes (a ``LocalSupervisor``, as on one host) on the coordinator's
orders, and reports them in one status key that is also its lease: every
``heartbeat_interval_s``, at once when a process exits (ringing the coordinator's report bell).

Fencing: an agent that has not completed a round trip with the coordinator's store for its lease
(half the coordinator's host timeout) kills every process of its host and exits (code 3), before
the coordinator declares the host lost and gives its ranks away. Its workers hold a shorter lease
of their own (``heartbeat_lease_s``) and stop first. Nothing of a fenced host is accepted later:
its processes are gone, and a process the coordinator no longer counts cannot commit a step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from checkpointless.config import JobConfig
from checkpointless.control.auth import SignedStore, job_namespace
from checkpointless.control.client import SLOW_STORE_CAP, redial, store_accepts
from checkpointless.errors import LaunchError
from checkpointless.launch.agent_join import join_job
from checkpointless.launch.cluster_spec import host_timeout, status_interval
from checkpointless.launch.relay import Relay
from checkpointless.launch.supervisor import LocalSupervisor
from checkpointless.launch.wakeups import Wakeups
from checkpointless.observe.usage import UsageSampler
from checkpointless.protocol import keys
from checkpointless.protocol.env import ENV_AGENT_PID, ENV_CLOCK_SKEW, ENV_HOST_ADDR, ENV_NODE, ENV_RELAY
from checkpointless.sockets import interface_of

log = logging.getLogger(__name__)

AGENT_NICE = -10  # where the agent may raise its priority (root, or RLIMIT_NICE)
EXIT_LOST = 3  # the coordinator stopped answering: this host fenced itself
_ORDER_WAIT = timedelta(hours=1)  # a timed-out wait logs two c10d warnings: wait long
_RETRY_S = 0.1  # a status that could not be sent is tried again this soon
_REDIAL_S = 0.5  # a connection that failed is dialled again this often (a fenced host: as often)
_STOP_GRACE_S = 5.0  # a stopped job's processes may exit by themselves this long, then are killed


class HostAgent:
    """One host's agent in a multi-host job (see the module docstring)."""

    def __init__(
        self,
        coordinator: str,
        secret: bytes,
        command: list[str],
        *,
        nproc: int,
        spare: bool = False,
        host: str = "",
        addr: str = "",
        log_dir: Path | None = None,
        node_rank: int | None = None,
        join_timeout_s: float = 60.0,
        clock_skew_s: float = 0.0,
        rejoin_window_s: float = 0.0,
        notice_file: Path | None = None,
    ) -> None:
        """``notice_file``: a path whose appearance is a preemption notice for this host (what a
        cloud's notice handler writes): the host drains, as on the agent's SIGTERM."""
        self.coordinator, self._secret, self.command = coordinator, secret, command
        self.notice_file = notice_file
        self.rejoin_window_s = rejoin_window_s
        self._fenced_at: float | None = None  # when it fenced its host, waiting to rejoin
        self.clock_skew_s = clock_skew_s
        self.nproc, self.spare, self.node_rank = nproc, spare, node_rank
        self.host = host or socket.gethostname()
        self.addr = addr  # "": found once the coordinator answers (its name may not resolve yet)
        self.log_dir = log_dir
        self.join_timeout_s = join_timeout_s
        self._seq = 0
        self._stopping = 0.0  # when a stop order's grace period ends (0: no stop order)
        self._failed_spawns: dict[str, str] = {}  # processes it could not start: name -> why
        self._beat = threading.Event()  # publish the status now (an order was carried out)
        self._wakeups = Wakeups()  # ends the status loop's wait: a process exited, an order came
        self._sampler = UsageSampler()  # the host's CPU, memory, accelerators
        self._last_usage: dict[str, Any] = {}
        self._closing = False
        self._lease_s = 1.0
        self._reset_done: int | None = None  # the index of the last reset order carried out
        # a notice for the host: its SIGTERM (set by the handler), the notice file, a drain order
        self.drain_asked = False
        self._draining = False  # the host's processes were told (SIGTERM: each hands its rank over)

    # -- joining ------------------------------------------------------------------------
    def join(self) -> tuple[JobConfig, str, int]:
        """(job, job id, this host's node index); ``LaunchError`` in one line if it cannot join."""
        joined = join_job(
            self.coordinator, self._secret, host=self.host, addr=self.addr, nproc=self.nproc, spare=self.spare,
            node_rank=self.node_rank, timeout_s=self.join_timeout_s,
        )  # fmt: skip
        self.store, self.addr = joined.store, joined.addr
        return joined.job, joined.job_id, joined.node

    # -- running --------------------------------------------------------------------------
    def run(self) -> int:
        job, job_id, node = self.join()
        # the agent holds its host's lease: its few milliseconds a beat come before the training's
        # (its processes start at the normal priority again, ``supervisor.py``)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, AGENT_NICE)
        env = {ENV_NODE: str(node), ENV_AGENT_PID: str(os.getpid()), ENV_HOST_ADDR: self.addr}
        if self.clock_skew_s:
            env[ENV_CLOCK_SKEW] = repr(self.clock_skew_s)
        ifname = interface_of(self.addr)
        if ifname is not None:  # every data-plane group binds to the host's address
            env.setdefault("GLOO_SOCKET_IFNAME", ifname)
            env.setdefault("NCCL_SOCKET_IFNAME", ifname)
        logdir = self.log_dir or Path(f"/tmp/checkpointless-{job_id}-{self.host}")
        wakeups = self._wakeups
        wakeups.open()
        # the host's processes beat into the agent's store; the relay forwards them as one
        self.relay = Relay(
            self.host, self.coordinator, self._secret, names=lambda: list(self.agent.children),
            interval=job.recovery.heartbeat_interval_s, lease_s=job.recovery.lease_s,
            clock_skew_s=self.clock_skew_s,
        )  # fmt: skip
        env[ENV_RELAY] = self.relay.addr
        # its own job id per host: the node's shared-memory batch cache is the host's
        self.agent = LocalSupervisor(
            job, self.command, job_id=f"{job_id}-{self.host}", secret=self._secret, store_addr=self.coordinator,
            logdir=logdir, env=env, wakeups=wakeups, host=self.host,
        )  # fmt: skip
        self._lease_s = host_timeout(job) / 2
        # the host's status is its heartbeat: a few per host timeout
        interval = status_interval(job)
        orders = threading.Thread(target=self._order_loop, name="agent-orders", daemon=True)
        orders.start()
        self.relay.start()
        try:
            return self._status_loop(wakeups, interval)
        finally:
            self._closing = True
            for child in list(self.agent.children.values()):
                child.kill()
            self.agent.stop()
            self.relay.close()
            self.agent.free_node_cache()
            wakeups.close()

    def _order_loop(self) -> None:
        """Carry out the coordinator's orders as they come (a blocking wait on the next one's key:
        no polling), on the main connection."""
        index = 0
        broken, pause = False, 0.05
        while not self._closing:
            if broken:  # never an operation on a broken connection: each logs a c10d stack trace
                time.sleep(pause)
                pause = min(2 * pause, _REDIAL_S)  # soon after a blip, then a few times a second
                broken = not self._reconnect(self._lease_s)
                continue
            pause = 0.05
            key = keys.node_order(self.host, index)
            try:
                self.store.raw.wait([self.store.name(key)], _ORDER_WAIT)
                text = self.store.get(key)
                if text is None:
                    continue  # forged (the real one overwrites it)
                self.store.delete(key)
            except (RuntimeError, OSError) as e:  # the status loop's lease decides when to give up
                log.debug("agent %s: store error (%s); reconnecting", self.host, e)
                broken = True
                continue
            index += 1
            self._obey(json.loads(text))
            self._beat.set()  # the answer: a status now (the coordinator waits for it, remote.py)
            self._wakeups.ring()

    def _status_loop(self, wakeups: Wakeups, interval: float) -> int:
        """The host's status, every ``interval`` and at once when a process exits or an order was
        carried out, on a connection of its own: also the agent's lease (each beat ends with a
        round trip). Nothing else the agent does (starting a process on a loaded host can take a
        second) delays it. Without an answer for the lease the host fences itself: every process
        killed, the agent gone (``EXIT_LOST``). Returns 0 once a stop order is done."""
        last_ok = time.monotonic()
        store: SignedStore | None = self._connect(self._lease_s)
        reported: set[str] = set()
        next_beat = 0.0
        while True:
            wakeups.wait(max(0.0, min(interval, next_beat - time.monotonic())))
            self._stop_late()
            if not self.drain_asked and self.notice_file is not None and self.notice_file.exists():
                log.warning("agent %s: the notice file %s appeared", self.host, self.notice_file)
                self.drain_asked = True
            if self.drain_asked and not self._draining:
                self._drain()
            exited = [n for n, c in list(self.agent.children.items()) if not c.alive() and n not in reported]
            for name in exited:
                reported.add(name)
                wakeups.forget(name)
            if not exited and not self._beat.is_set() and time.monotonic() < next_beat:
                continue
            self._beat.clear()
            next_beat = time.monotonic() + interval
            try:
                if store is None:  # dropped when it failed: a broken one logs a stack trace per use
                    store = self._connect(max(self._lease_s - (time.monotonic() - last_ok), _REDIAL_S))
                stopped = self._report(store)
                if exited:  # the coordinator waits for it: wake it now
                    store.set(keys.REPORT_BELL, "1")
                store.add(keys.AGENTS_COUNT, 0)  # the round trip that renews the lease
                last_ok = time.monotonic()
                self._fenced_at = None  # the coordinator answers again (it resets this host if lost)
                if stopped:
                    return 0
            except (RuntimeError, OSError) as e:
                silent = time.monotonic() - last_ok
                if self._fenced_at is not None:
                    if time.monotonic() - self._fenced_at > self.rejoin_window_s:
                        self._exit_lost(silent)
                elif silent > self._lease_s and not (
                    silent <= SLOW_STORE_CAP * self._lease_s
                    and store_accepts(self.coordinator, self._lease_s / 2)
                ):  # a store that still accepts connections is late, not gone (LeaseWatchdog, lease.py)
                    self._fence(silent)
                # the status again soon, not a beat later: a host back from a partition tells the
                # coordinator what happened meanwhile (its processes' exits) before it is lost
                next_beat = time.monotonic() + min(
                    interval, _RETRY_S if self._fenced_at is None else _REDIAL_S
                )
                log.debug("agent %s: status not sent (%s); reconnecting", self.host, e)
                store = None
                with contextlib.suppress(RuntimeError, OSError):
                    store = self._connect(self._lease_s - silent)

    def _drain(self) -> None:
        """A notice for the whole host (its agent's SIGTERM, what Kubernetes sends a pod and Slurm a
        step's tasks; its notice file; ``checkpointless drain``'s order): every process of the host
        gets SIGTERM (a worker hands its rank over, a spare ends), the status says ``draining`` (no
        new spare comes here, none there gets a rank), and once none is left the status says
        ``drained`` and the agent exits 0."""
        self._draining = True
        log.warning("agent %s: a notice: draining this host (its ranks are handed over)", self.host)
        for child in list(self.agent.children.values()):
            if child.alive():
                with contextlib.suppress(OSError):
                    os.kill(child.pid, signal.SIGTERM)
        self._beat.set()

    def _fence(self, silent: float) -> None:
        """The coordinator is out of reach for the lease: stop this host's training, now; then exit,
        or wait ``rejoin_window_s`` for the coordinator to answer again (a partition that heals)."""
        for child in list(self.agent.children.values()):
            with contextlib.suppress(OSError):
                child.kill()
        print(f"checkpointless agent {self.host}: lost the coordinator at {self.coordinator} (no answer for "
              f"{silent:.1f}s, lease {self._lease_s:g}s); stopped every process of this host", file=sys.stderr,
              flush=True)  # fmt: skip
        if self.rejoin_window_s <= 0:
            os._exit(EXIT_LOST)
        self._fenced_at = time.monotonic()
        print(f"checkpointless agent {self.host}: waiting up to {self.rejoin_window_s:g}s for the coordinator to "
              "come back (then this host rejoins as a spare host)", file=sys.stderr, flush=True)  # fmt: skip

    def _exit_lost(self, silent: float) -> None:
        print(f"checkpointless agent {self.host}: the coordinator at {self.coordinator} did not come back "
              f"({silent:.1f}s without an answer); exiting", file=sys.stderr, flush=True)  # fmt: skip
        os._exit(EXIT_LOST)

    def _connect(self, left: float) -> SignedStore:
        # a round trip waits at most a quarter lease: a connection stuck behind a partition is
        # dropped and dialled again (a new one works at once when the link is back; the old one
        # waits for TCP's retransmission back-off, seconds after the link healed)
        return SignedStore(
            redial(self.coordinator, left, timedelta(seconds=min(max(0.2, left), self._lease_s / 4))),
            self._secret, namespace=job_namespace(self._secret),
        )  # fmt: skip

    def _reconnect(self, left: float) -> bool:
        """A new main connection (the order loop's); whether it was made."""
        try:
            self.store = self._connect(left)
        except (RuntimeError, OSError):
            return False
        return True

    def _obey(self, order: dict[str, Any]) -> None:
        op = order.get("op")
        if op == "spawn":
            try:
                self.agent.spawn(str(order["name"]), str(order["role"]))
            except LaunchError as e:
                log.error("agent %s: %s", self.host, e)
                self._failed_spawns[str(order["name"])] = str(e)
        elif op == "kill":
            child = self.agent.children.get(str(order["name"]))
            if child is not None:
                child.kill()
        elif op == "ping":  # the coordinator asks for a sign of life: the status that follows
            pass
        elif op == "reset":  # this host was lost (a partition it came back from): its processes go
            self._reset(int(order.get("index", -1)))
        elif op == "drain":  # ``checkpointless drain``: the status loop drains the host
            self.drain_asked = True
        elif op == "stop":  # a grace period (the ranks see job/stop), then by force (``_stop_late``)
            self._stopping = self._stopping or time.monotonic() + _STOP_GRACE_S

    def _reset(self, index: int) -> None:
        """Kill every process of this host and wait until they are gone; the status then says
        ``reset``: the coordinator takes the host back as a spare host (``RemoteNodes._rejoin``)."""
        for child in list(self.agent.children.values()):
            child.kill()
        for child in list(self.agent.children.values()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=5)
        self._failed_spawns.clear()
        self._reset_done = index
        log.warning("agent %s: this host was lost to the job; its processes are stopped, it waits as a spare host",
                    self.host)  # fmt: skip

    def _stop_late(self) -> None:
        """Kill what is still alive once the stop's grace period is over."""
        if self._stopping and time.monotonic() > self._stopping:
            for child in self.agent.children.values():
                child.kill()

    def _report(self, store: SignedStore) -> bool:
        """Publish the host's status; whether it says that every process stopped after a stop order."""
        procs: dict[str, dict[str, Any]] = {}
        children = list(self.agent.children.items())
        for name, child in children:
            alive = child.alive()
            procs[name] = {"alive": alive, "pid": child.popen.pid, "slot": child.slot,
                           "exit": None if alive else child.exitcode(), "cpu": child.cpu_seconds()}  # fmt: skip
            if not alive:
                procs[name]["tail"] = child.log_tail()
        for name, error in list(self._failed_spawns.items()):
            procs[name] = {"alive": False, "exit": 127, "tail": error}
        stopped = bool(self._stopping) and not any(p["alive"] for p in procs.values())
        if stopped:  # their last events before the word that they are gone
            self.relay.flush()
        self._seq += 1
        if self._seq % 5 == 1:  # every few beats: a second or so apart, what the launcher records
            self._last_usage = self._sampler.sample()
        status = {"seq": self._seq, "procs": procs, "stopped": stopped, "usage": self._last_usage}
        if self._draining:
            status["draining"] = True
            # (once the job's end stopped them, they are stopped, not drained)
            if not self._stopping and not any(p["alive"] for p in procs.values()):
                # its processes' last events before the word that they are gone
                self.relay.flush()
                status["drained"] = stopped = True
        if self._reset_done is not None:
            status["reset"] = self._reset_done
        store.set(keys.node_status(self.host), json.dumps(status))
        return stopped


def _stop_on_signals(agent: HostAgent) -> None:
    """A first SIGTERM drains the host (``HostAgent._drain``, from the status loop: the handler
    only sets a flag); a second ends the agent like Ctrl-C: its ``finally`` stops its processes."""

    def handler(signum: int, frame: Any) -> None:
        if agent.drain_asked:
            raise KeyboardInterrupt
        agent.drain_asked = True

    signal.signal(signal.SIGTERM, handler)


def main_agent(agent: HostAgent) -> int:
    """Run ``agent``; the process ends here once it has stopped its processes. It exits at once
    (``os._exit``): its order thread may be blocked in the store's ``wait``, and tearing the
    interpreter down under it aborted the process now and then ("terminate called without an
    active exception", exit -6 instead of 0)."""
    _stop_on_signals(agent)
    try:
        code = agent.run()
    except KeyboardInterrupt:
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
