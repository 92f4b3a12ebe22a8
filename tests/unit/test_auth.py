"""Sealed control values: a value verifies only under its own key and the job's secret."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from checkpointless.control.auth import SignedStore, new_secret, pg_token, read_secret_fd
from checkpointless.launch.launcher import open_store

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def store() -> TCPStore:
    return open_store("127.0.0.1", 0)


def test_sealed_value_round_trips_and_forgeries_are_rejected_once(store: TCPStore) -> None:
    rejected: list[str] = []
    ours = SignedStore(store, new_secret(), rejected.append)
    ours.set("gen/1/plan", '{"gen": 1}')
    assert ours.get("gen/1/plan") == '{"gen": 1}'
    assert ours.get("gen/2/plan") is None and rejected == []  # absent is not forged

    stranger = SignedStore(store, new_secret())
    stranger.set("job/stop", "1")  # sealed with another job's secret
    store.set("done/0", b'{"digest": "evil"}')  # not sealed at all
    store.set("gen/3/plan", store.get("gen/1/plan"))  # a real value replayed under another key
    for _ in range(3):
        assert ours.get("job/stop") is None
        assert ours.get("done/0") is None
        assert ours.get("gen/3/plan") is None
    assert sorted(rejected) == ["done/0", "gen/3/plan", "job/stop"]  # each forgery recorded once


def test_wait_returns_none_for_a_forged_value(store: TCPStore) -> None:
    ours = SignedStore(store, new_secret())
    assert ours.wait("assign/s0", timedelta(seconds=0.05)) is None  # timed out
    store.set("assign/s0", b"1")
    assert ours.wait("assign/s0", timedelta(seconds=1)) is None  # there, but forged
    ours.set("assign/s0", "1")
    assert ours.wait("assign/s0", timedelta(seconds=1)) == "1"


def test_secret_travels_through_a_pipe_and_tokens_differ_per_job_and_generation() -> None:
    secret = new_secret()
    r, w = os.pipe()
    os.write(w, secret)
    os.close(w)
    assert read_secret_fd(r) == secret
    assert pg_token(secret, 1) != pg_token(secret, 2) != pg_token(new_secret(), 2)
    r, w = os.pipe()
    os.write(w, b"short")
    os.close(w)
    with pytest.raises(RuntimeError, match="5 bytes"):
        read_secret_fd(r)


def test_store_listens_on_the_requested_address_only(store: TCPStore) -> None:
    port = store.port
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    listening.append(local.rsplit(":", 1)[0])
    assert listening == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or ::


def test_a_namespace_hides_the_job_keys_from_a_stranger_who_knows_the_protocol(store: TCPStore) -> None:
    from checkpointless.control.auth import job_namespace

    secret = new_secret()
    ours = SignedStore(store, secret, namespace=job_namespace(secret))
    ours.set("hb/w0", '{"seq": 7}')
    store.set("hb/w0", b"garbage")  # the protocol's plain name: a different key
    assert ours.get("hb/w0") == '{"seq": 7}'
    assert job_namespace(secret) != job_namespace(new_secret())
    assert job_namespace(secret).startswith("j") and job_namespace(secret).endswith("/")


def test_many_keys_are_read_in_batches_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """``get_sealed_present`` splits a long read (c10d's libuv server refuses over 131,072 keys in
    one request) and keeps the keys' order."""
    import torch.distributed as dist

    from checkpointless.control import auth

    monkeypatch.setattr(auth, "MULTI_GET_KEYS", 3)
    store = SignedStore(dist.HashStore(), new_secret())
    names = [f"k{i}" for i in range(10)]
    for i, k in enumerate(names):
        store.set(k, str(i))
    raws = store.get_sealed_present(names)
    assert [store.open(k, r) for k, r in zip(names, raws, strict=True)] == [str(i) for i in range(10)]
    assert store.get_sealed_present([]) == []
