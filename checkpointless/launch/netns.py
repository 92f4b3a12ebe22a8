"""Hosts on one machine: network namespaces joined by a bridge (``checkpointless cluster``).

Each host is a named network namespace with its own address on a private /24, its own loopback
and, for the processes started in it, its own hostname (a UTS namespace per process tree:
``unshare --uts``). The bridge lives in this machine's namespace with the subnet's first address:
the coordinator listens there.

Nothing outlives the command. Named namespaces and the bridge would survive a killed parent, so a
small reaper process, in its own session (a terminal's Ctrl-C does not reach it), waits on a pipe
from the command: when the pipe closes (the command exited, or was SIGKILLed) it kills every
process left in the namespaces and removes them and the bridge. The command removes them itself
on a normal exit; the reaper then finds nothing to do.
"""

from __future__ import annotations

import contextlib
import glob
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from checkpointless.errors import LaunchError

MAX_HOSTS = 64
"""Hosts one ``cluster`` may make: every host is a few processes and a namespace on this machine."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise LaunchError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no address or route of this machine overlaps."""
    used: list[ipaddress.IPv4Network] = []
    for line in _ip("-o", "-4", "addr", "show").stdout.splitlines() + _ip("-4", "route").stdout.splitlines():
        for word in line.split():
            with contextlib.suppress(ValueError):
                if "/" in word or word[0].isdigit():
                    used.append(ipaddress.IPv4Network(word, strict=False))
    start = 64 + os.getpid() % 128  # two concurrent clusters rarely try the same one first
    for i in range(256 * 128):
        a, b = (start + i // 256) % 192 + 64, i % 256
        net = ipaddress.IPv4Network(f"10.{a}.{b}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise LaunchError("no free 10.x.y.0/24 subnet on this machine for the cluster's hosts")


@dataclass
class Topology:
    """What ``down`` needs (and the reaper receives as JSON)."""

    bridge: str
    namespaces: list[str]
    host_veths: list[str]
    leftovers: list[str] = field(default_factory=list)
    """Files and folders of the command's that must not outlive it either (the job's secret file,
    the run folder's control file, the hosts' logs when the run keeps none)."""
    leftover_globs: list[str] = field(default_factory=list)
    """Likewise, as glob patterns: what the command makes after the hosts are up (the launcher's
    temporary log folder, ``outputs.temp_logs_glob``)."""


def down(t: Topology) -> None:
    """Kill every process in the namespaces, remove them, the bridge and the leftovers (idempotent)."""
    for ns in t.namespaces:
        for _ in range(3):
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.05)
        _ip("netns", "del", ns, check=False)
    for veth in t.host_veths:
        _ip("link", "del", veth, check=False)
    _ip("link", "del", t.bridge, check=False)
    for path in [*t.leftovers, *(p for pattern in t.leftover_globs for p in glob.glob(pattern))]:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class Hosts:
    """``n`` hosts as network namespaces (see the module docstring); a context manager."""

    def __init__(
        self, n: int, leftovers: list[str] | None = None, leftover_globs: list[str] | None = None
    ) -> None:
        """``leftovers``, ``leftover_globs``: paths, and glob patterns of paths, removed with the
        hosts (``Topology.leftovers``)."""
        if not 1 <= n <= MAX_HOSTS:
            raise LaunchError(f"{n} hosts: this machine makes 1 to {MAX_HOSTS}")
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
            raise LaunchError("checkpointless cluster makes network namespaces: it needs root, ip (iproute2) "
                              "and unshare (util-linux)")  # fmt: skip
        tag = f"{os.getpid() % 100000:05d}"
        self.n = n
        self.topology = Topology(
            bridge=f"clbr{tag}",
            namespaces=[f"cl{tag}h{i}" for i in range(n)],
            host_veths=[f"clv{tag}h{i}" for i in range(n)],
            leftovers=list(leftovers or []),
            leftover_globs=list(leftover_globs or []),
        )
        self.hostnames = [f"host{i}" for i in range(n)]
        self._reaper: subprocess.Popen[bytes] | None = None
        self.subnet: ipaddress.IPv4Network | None = None

    @property
    def bridge_addr(self) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def addr(self, i: int) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 10 + i)

    def __enter__(self) -> Hosts:
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "checkpointless.launch.netns", json.dumps(self.topology.__dict__)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            self._up()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _up(self) -> None:
        t = self.topology
        self.subnet = _free_subnet()
        _ip("link", "add", t.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_addr}/24", "dev", t.bridge)
        _ip("link", "set", t.bridge, "up")
        for i, (ns, veth) in enumerate(zip(t.namespaces, t.host_veths, strict=True)):
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            _ip("link", "set", veth, "master", t.bridge)
            _ip("link", "set", veth, "up")
            _ip("link", "set", f"{veth}p", "netns", ns)
            _ip("-n", ns, "link", "set", f"{veth}p", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def argv(self, i: int, command: list[str]) -> list[str]:
        """``command`` run on host ``i``: in its network namespace, with its own hostname."""
        return ["ip", "netns", "exec", self.topology.namespaces[i], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostnames[i], *command]  # fmt: skip

    def cut(self, i: int) -> None:
        """Cut host ``i`` off the network, its processes alive (a partition)."""
        _ip("link", "set", self.topology.host_veths[i], "down")

    def pids(self, i: int) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", self.topology.namespaces[i], check=False).stdout.split()]

    def __exit__(self, *exc: object) -> None:
        down(self.topology)
        if self._reaper is not None:
            with contextlib.suppress(OSError):
                assert self._reaper.stdin is not None
                self._reaper.stdin.close()  # the reaper finds nothing left and exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(timeout=10)
            self._reaper = None


def _reap(spec: str) -> None:
    """The reaper: wait for the command's pipe to close, then remove what it made."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        while sys.stdin.buffer.read(4096):
            pass
    down(Topology(**json.loads(spec)))


if __name__ == "__main__":
    _reap(sys.argv[1])
