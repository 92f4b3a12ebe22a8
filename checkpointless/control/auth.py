"""Authenticated values on the control store: every message carries an HMAC of the job's secret.

The control store is a plain c10d ``TCPStore``: anyone who can connect can read
and write any key. The launcher therefore creates a per-job secret, hands it to
each child over a private pipe (never the command line, the environment or a
log), and every value the protocol writes is *sealed*::

    <hex HMAC-SHA256(secret, key NUL value)> "." <value>

Binding the key name into the MAC stops a sealed value from being replayed
under another key (a generation 1 plan as generation 2's). A reader opens a
value with the same secret; a value that does not verify is treated as absent
and reported through ``on_reject``, so a stranger (or a process of another job
on a reused port) can neither forge a plan, a heartbeat, a failure report or a
final digest, nor stop the job. Counters (``add``) cannot be sealed: the
protocol uses them only as hints that a sealed value may be there.

Sealing stops forgery, not destruction: on a last-writer-wins store a stranger
who knows a key's name can overwrite or delete a real value before it is read (a
heartbeat, faster than it beats). A job's keys live under a *namespace* derived
from the secret (``job_namespace``), and the data-plane rendezvous of each
generation under a prefix derived from it too (``pg_token``), so that they are
not guessable; but c10d's ``TCPStore`` answers ``list_keys()`` to anyone who
reaches its port, so they are not secret either. Hence the rule every reader
follows: **a key's existence proves nothing**. Existence may be the cheap hint
that a value is worth opening (one ``check`` round trip); only a value whose
seal opens decides anything. Integrity thus holds against anyone; availability
(a stranger deleting or overwriting real values) only on a network that the
job's hosts alone reach, which is what the job asks of its network, as torchrun
and torchft do. The coordinator also watches the protocol's plain names and
records any write to them as an intrusion attempt.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import DistStoreError

from checkpointless.protocol.env import ENV_SECRET_FD

SECRET_BYTES = 32

_MAC_HEX = 64


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def write_secret_file(path: Path, secret: bytes) -> None:
    """Write ``secret`` (hex, one line) to a new file that only this user may read (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")


def read_secret_file(path: Path) -> bytes:
    """The job's secret from a file written by ``write_secret_file`` (or by hand: 64 hex digits,
    from ``openssl rand -hex 32``). Refused in one line (``ValueError``) if others may read the
    file: a secret on a shared file system is only as private as its mode."""
    try:
        st = os.stat(path)
        text = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"secret file {path}: {e.strerror or e}") from None
    if st.st_mode & 0o077:
        raise ValueError(
            f"secret file {path}: readable by others (mode {st.st_mode & 0o777:o}); chmod 600 {path}"
        )
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"secret file {path}: expected {2 * SECRET_BYTES} hex digits (openssl rand -hex 32)")
    return secret


def read_secret_fd(fd: int) -> bytes:
    """Read the secret the launcher wrote into an inherited pipe, then close it."""
    chunks = []
    try:
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    secret = b"".join(chunks)
    if len(secret) != SECRET_BYTES:
        raise RuntimeError(
            f"the job secret read from the launcher has {len(secret)} bytes, not {SECRET_BYTES}"
        )
    return secret


def secret_from_env() -> bytes:
    """The secret of this process's job (read once; the descriptor is closed after reading)."""
    global _SECRET
    if _SECRET is None:
        fd = os.environ.pop(ENV_SECRET_FD, None)
        if fd is None:
            raise RuntimeError(f"{ENV_SECRET_FD} is not set: this process was not started by the launcher")
        _SECRET = read_secret_fd(int(fd))
    return _SECRET


_SECRET: bytes | None = None


def mac(secret: bytes, *parts: bytes) -> bytes:
    # not ``hmac.digest``: as fast here, but it releases the GIL at every call, so every other
    # thread of the coordinator's process (the report bell, a profiler) runs in the middle of its
    # read of every host's value (bench/control_scale.py)
    return hmac.new(secret, b"\0".join(parts), hashlib.sha256).digest()


MULTI_GET_KEYS = 8192
"""Keys per ``multi_get`` round trip: c10d's libuv store server resets a request naming more than
131,072 (``MAX_KEY_COUNT``); a coordinator reading a long backlog of event chunks sent one at 2,000
hosts and lost the job (bench/control_scale.py)."""


def job_namespace(secret: bytes) -> str:
    """The unguessable prefix of every key of the job whose secret this is."""
    return "j" + mac(secret, b"namespace").hex()[:24] + "/"


def control_token(secret: bytes) -> str:
    """The credential of the run folder's control file (``launch/outputs.py``): derived from the
    job's secret, never the secret itself, so a command that reads it can ask the job for things
    (its size, a drain) but cannot seal the job's own messages."""
    return mac(secret, b"control").hex()


def pg_token(secret: bytes, gen: int) -> str:
    """The unguessable part of generation ``gen``'s rendezvous prefix."""
    return mac(secret, b"pg", str(gen).encode()).hex()[:32]


class _ClosedStore:
    """What a closed ``SignedStore`` reads and writes: every call fails as a store gone away."""

    def __getattr__(self, name: str) -> Any:
        def closed(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"the control store is closed ({name})")

        return closed


class SignedStore:
    """A c10d store whose values are sealed with the job's secret (see the module doc).

    ``on_reject(key)`` is called once per key and value that fails to verify.
    Keys are the protocol's names (``keys.py``); with a ``namespace`` (the
    launcher and the workers use ``job_namespace(secret)``) they are stored
    under it.
    """

    def __init__(
        self,
        store: Any,
        secret: bytes,
        on_reject: Callable[[str], None] | None = None,
        *,
        namespace: str = "",
    ) -> None:
        self.raw = store
        self.secret = secret
        self.on_reject = on_reject
        self.namespace = namespace
        self._rejected: set[tuple[str, bytes]] = set()

    def close(self) -> None:
        """Let go of the underlying store: the launcher's is a ``TCPStore`` server, whose thread,
        listener and connections end once the last reference to it goes (the launcher's objects
        hold this one in reference cycles, which only a full collection would free). Any later
        use raises ``RuntimeError``, as a store that went away does."""
        self.raw = _ClosedStore()

    def reconnected(self, store: Any) -> None:
        """The underlying store is a new connection to the same server from now on."""
        self.raw = store

    def name(self, key: str) -> str:
        """Where ``key`` lives in the underlying store."""
        return self.namespace + key

    def seal(self, key: str, value: str) -> bytes:
        data = value.encode()
        return mac(self.secret, key.encode(), data).hex().encode() + b"." + data

    def open(self, key: str, raw: bytes) -> str | None:
        """The value of a sealed ``raw`` read from ``key``, or None (and ``on_reject``) if forged."""
        tag, sep, data = raw.partition(b".")
        ok = bool(sep) and len(tag) == _MAC_HEX
        if ok:
            expected = mac(self.secret, key.encode(), data).hex().encode()
            ok = hmac.compare_digest(tag, expected)
        if ok:
            return data.decode()
        marker = (key, hashlib.sha256(raw).digest())
        if marker not in self._rejected:
            self._rejected.add(marker)
            if self.on_reject is not None:
                self.on_reject(key)
        return None

    def set(self, key: str, value: str) -> None:
        self.raw.set(self.name(key), self.seal(key, value))

    def multi_set(self, values: dict[str, str]) -> None:
        """Set every key of ``values`` in one round trip."""
        if values:
            names = [self.name(k) for k in values]
            self.raw.multi_set(names, [self.seal(k, v).decode() for k, v in values.items()])

    def get_sealed(self, key: str) -> bytes | None:
        """The raw (still sealed) bytes of ``key``, or None if absent; ``open`` verifies them."""
        name = self.name(key)
        if not self.raw.check([name]):
            return None
        return bytes(self.raw.get(name))

    def get_sealed_present(self, keys: list[str]) -> list[bytes]:
        """The raw bytes of ``keys`` in one round trip. Every key must exist (a store's
        ``multi_get`` waits for an absent one until its timeout): keys nothing deletes, read before."""
        out: list[bytes] = []
        for i in range(0, len(keys), MULTI_GET_KEYS):  # the libuv server refuses over 131,072 keys
            out += [
                bytes(v) for v in self.raw.multi_get([self.name(k) for k in keys[i : i + MULTI_GET_KEYS]])
            ]
        return out

    def get(self, key: str) -> str | None:
        """The verified value of ``key``; None if it is absent or forged."""
        raw = self.get_sealed(key)
        return None if raw is None else self.open(key, raw)

    def is_set(self, key: str) -> bool:
        """True if ``key`` holds a value sealed by this job."""
        return self.get(key) is not None

    def wait(self, key: str, timeout: timedelta) -> str | None:
        """Wait up to ``timeout`` for ``key`` to exist; its verified value or None."""
        try:
            self.raw.wait([self.name(key)], timeout)
        except DistStoreError:  # the wait timed out
            return None
        return self.get(key)

    def add(self, key: str, amount: int) -> int:
        """A counter: unauthenticated by nature, so only ever a hint."""
        return int(self.raw.add(self.name(key), amount))

    def delete(self, key: str) -> None:
        self.raw.delete_key(self.name(key))
