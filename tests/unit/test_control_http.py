"""The control endpoint (``launch/control_http.py``) over real HTTP on loopback: the bearer token,
the body's checks, the size request handed to ``SizeRequests``, a silent stranger, ``close``."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from checkpointless.control.size_requests import SizeRequests
from checkpointless.launch.control_http import ControlServer

pytestmark = pytest.mark.timeout(30)

TOKEN = "s3cret-token"


@pytest.fixture
def requests() -> SizeRequests:
    return SizeRequests(2, 4, 4)


@pytest.fixture
def server(requests: SizeRequests) -> Iterator[ControlServer]:
    server = ControlServer(requests, TOKEN)
    server.start()
    yield server
    server.close()


def call(
    server: ControlServer,
    method: str,
    path: str = "/scale",
    body: bytes | None = None,
    token: str | None = TOKEN,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    host, port = server.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        all_headers = {
            **({"Authorization": f"Bearer {token}"} if token is not None else {}),
            **(headers or {}),
        }
        conn.request(method, path, body=body, headers=all_headers)
        response = conn.getresponse()
        assert response.getheader("Content-Type") == "application/json"
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def post(server: ControlServer, payload: Any, token: str | None = TOKEN) -> tuple[int, Any]:
    return call(server, "POST", body=json.dumps(payload).encode(), token=token)


def test_a_size_in_bounds_is_accepted_and_handed_to_the_coordinator(
    server: ControlServer, requests: SizeRequests
) -> None:
    status, reply = post(server, {"workers": 3})
    assert status == 202
    assert reply == {
        "ok": True,
        "workers": 3,
        "size": 4,
        "replicas": 4,
        "target": 4,
        "finished": False,
        "min": 2,
        "max": 4,
    }
    assert requests.take() == 3
    assert requests.take() is None


@pytest.mark.parametrize("token", [None, "wrong", TOKEN[:-1], TOKEN + "x", ""])
def test_a_missing_or_wrong_token_is_refused(
    server: ControlServer, requests: SizeRequests, token: str | None
) -> None:
    assert post(server, {"workers": 3}, token=token) == (
        401,
        {"ok": False, "error": "missing or wrong bearer token"},
    )
    assert call(server, "GET", token=token)[0] == 401
    assert requests.take() is None


def test_the_token_is_checked_before_the_body(server: ControlServer) -> None:
    assert call(server, "POST", body=b"not json", token="wrong")[0] == 401


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (json.dumps({"workers": 5}).encode(), "between --min-workers 2 and --max-workers 4, got 5"),
        (json.dumps({"workers": True}).encode(), "must be an integer"),
        (json.dumps({"workers": "3"}).encode(), "must be an integer"),
        (b"not json", "JSON object"),
        (b"\xff\xfe", "JSON object"),
        (json.dumps([3]).encode(), "JSON object"),
        (json.dumps({"replicas": 3}).encode(), "JSON object"),
        (b"", "JSON object"),
    ],
)
def test_a_bad_body_is_refused_with_one_line(
    server: ControlServer, requests: SizeRequests, body: bytes, words: str
) -> None:
    status, reply = call(server, "POST", body=body)
    assert status == 400
    assert reply["ok"] is False and words in reply["error"] and "\n" not in reply["error"]
    assert requests.take() is None


def test_an_oversized_body_is_refused_unread(server: ControlServer) -> None:
    """Only the headers are sent: a server that read the declared body would wait for it."""
    host, port = server.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest("POST", "/scale")
        conn.putheader("Authorization", f"Bearer {TOKEN}")
        conn.putheader("Content-Length", "100000")
        conn.endheaders()
        started = time.monotonic()
        response = conn.getresponse()
        assert response.status in (400, 413)
        assert json.loads(response.read())["ok"] is False
        assert time.monotonic() - started < 2
    finally:
        conn.close()


@pytest.mark.parametrize("length", [None, "abc", "-1"])
def test_a_missing_or_invalid_content_length_is_refused(server: ControlServer, length: str | None) -> None:
    host, port = server.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest("POST", "/scale", skip_accept_encoding=True)
        conn.putheader("Authorization", f"Bearer {TOKEN}")
        if length is not None:
            conn.putheader("Content-Length", length)
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 400
        assert json.loads(response.read())["ok"] is False
    finally:
        conn.close()


def test_get_says_where_the_job_stands(server: ControlServer, requests: SizeRequests) -> None:
    requests.observe(3, 4)
    assert call(server, "GET") == (
        200,
        {"size": 3, "replicas": 3, "target": 4, "finished": False, "min": 2, "max": 4},
    )


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/"), ("POST", "/scale/x"), ("GET", "/metrics"), ("PUT", "/scale"), ("DELETE", "/scale")],
)
def test_any_other_path_or_method_is_not_found(
    server: ControlServer, requests: SizeRequests, method: str, path: str
) -> None:
    status, reply = call(server, method, path, body=json.dumps({"workers": 3}).encode())
    assert status == 404 and reply["ok"] is False
    assert requests.take() is None


def test_a_silent_stranger_does_not_stop_a_real_request(server: ControlServer) -> None:
    """It holds one thread, and that one only until the request timeout closes its connection."""
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=15) as stranger:
        started = time.monotonic()
        assert post(server, {"workers": 3})[0] == 202
        assert time.monotonic() - started < 3
        assert stranger.recv(1) == b""  # closed by the server
        assert time.monotonic() - started < 10


def test_close_twice_is_fine_and_the_port_is_then_refused(requests: SizeRequests) -> None:
    server = ControlServer(requests, TOKEN)
    server.start()
    assert post(server, {"workers": 2})[0] == 202
    started = time.monotonic()
    server.close()
    server.close()
    assert time.monotonic() - started < 3
    host, port = server.address.rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5).close()


def test_close_without_start_is_fine(requests: SizeRequests) -> None:
    server = ControlServer(requests, TOKEN)
    server.close()
    server.close()


def test_every_interface_is_dialled_on_loopback(requests: SizeRequests) -> None:
    server = ControlServer(requests, TOKEN, host="0.0.0.0")
    try:
        assert server.address.startswith("127.0.0.1:")
    finally:
        server.close()
