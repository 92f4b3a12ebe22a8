"""The job's control endpoint over HTTP: ``POST /scale`` asks the job for a size
(:class:`~checkpointless.control.size_requests.SizeRequests`), ``GET /scale`` says where it stands;
``POST /drain`` asks it to drain a host (:class:`~checkpointless.launch.drains.DrainRequests`).

Every request carries ``Authorization: Bearer <token>``, the token of the run's ``control.json``
(readable by its user only); ``checkpointless scale`` and ``checkpointless drain``
(``cli/job_control.py``) are the clients. Replies are JSON: ``{"ok": false, "error": "<one line>"}``
for every refusal.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from checkpointless.control.size_requests import SizeRequests
from checkpointless.launch.drains import DrainRequests

log = logging.getLogger(__name__)

MAX_BODY = 4096
"""The largest ``POST`` body read (bytes); a larger one is refused unread."""
POLL = 0.1
"""How often the serving loop looks for ``close`` (seconds)."""
CLOSE_TIMEOUT = 5.0
"""How long ``close`` waits for the serving thread to end (seconds)."""


class ControlServer:
    """Serves ``/scale`` and ``/drain`` for one job on ``host:port`` (port 0: any free one) in a
    daemon thread, each request in its own daemon thread, until ``close``. ``drains``: None where
    the job has no hosts to drain (``POST /drain`` is then refused, 400)."""

    def __init__(
        self, requests: SizeRequests, token: str, host: str = "127.0.0.1", port: int = 0,
        drains: DrainRequests | None = None,
    ) -> None:  # fmt: skip
        assert token, "an empty token would let anyone in"
        self.requests = requests
        self.drains = drains
        self.token = token
        handler = functools.partial(_Handler, control=self)
        self._http = ThreadingHTTPServer((host, port), handler)  # binds now: the port is known
        bound, port = self._http.socket.getsockname()[:2]
        self._address = f"{bound if bound not in ('', '0.0.0.0') else '127.0.0.1'}:{port}"
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def address(self) -> str:
        """``host:port`` a client on this host dials (127.0.0.1 when bound to every interface)."""
        return self._address

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._http.serve_forever, args=(POLL,), name="cpl-control-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port; a request still in flight ends in its own thread.
        Idempotent; waits at most ``CLOSE_TIMEOUT`` for the serving thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:  # shutdown() would wait forever for a loop never started
            self._http.shutdown()  # the loop sees it within POLL
            self._thread.join(CLOSE_TIMEOUT)
        self._http.server_close()

    def authorized(self, header: str | None) -> bool:
        expected = f"Bearer {self.token}".encode()
        return hmac.compare_digest((header or "").encode(), expected)


_POST_FIELDS = {"/scale": "workers", "/drain": "node"}  # each request's one field
_EXAMPLES = {"workers": 4, "node": 1}


class _Handler(BaseHTTPRequestHandler):
    """One request to the control endpoint (a thread each)."""

    timeout = 5  # seconds a connection may stay silent: a stranger cannot hold a thread forever

    def __init__(self, *args: Any, control: ControlServer) -> None:
        self.control = control
        super().__init__(*args)  # handles the request

    def handle(self) -> None:
        try:
            super().handle()
        except OSError as exc:  # the client went away mid-reply
            log.debug("control http: %s: %s", self.client_address[0], exc)

    def do_GET(self) -> None:
        if self.path != "/scale":
            self._not_found()
        elif not self.control.authorized(self.headers.get("Authorization")):
            self._refuse(HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token")
        else:
            self._reply(HTTPStatus.OK, self.control.requests.view())

    def do_POST(self) -> None:
        field = _POST_FIELDS.get(self.path)
        if field is None:
            self._not_found()
            return
        if not self.control.authorized(self.headers.get("Authorization")):
            self._refuse(HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token")
            return
        length = self.headers.get("Content-Length", "")
        if not length.isdigit():
            self._refuse(HTTPStatus.BAD_REQUEST, "a JSON body with its Content-Length is needed")
            return
        if int(length) > MAX_BODY:
            self._refuse(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is over {MAX_BODY} bytes")
            return
        try:
            body = json.loads(self.rfile.read(int(length)))
        except ValueError:
            body = None
        if not isinstance(body, dict) or field not in body:
            self._refuse(
                HTTPStatus.BAD_REQUEST,
                f'the body must be a JSON object like {{"{field}": {_EXAMPLES[field]}}}',
            )
            return
        if self.path == "/scale":
            reason = self.control.requests.ask(body[field])
        elif self.control.drains is None:
            reason = "this job has no hosts to drain"
        else:
            reason = self.control.drains.ask(body[field])
        if reason is not None:
            self._refuse(HTTPStatus.BAD_REQUEST, reason)
            return
        self._reply(HTTPStatus.ACCEPTED, {"ok": True, field: body[field], **self.control.requests.view()})

    def _not_found(self) -> None:
        self._refuse(
            HTTPStatus.NOT_FOUND,
            f"no {self.command} {self.path} here (only GET and POST /scale, POST /drain)",
        )

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_found

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Every error as JSON, those of the request line (``BaseHTTPRequestHandler``'s) too."""
        self._refuse(code, message or HTTPStatus(code).phrase)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("control http: %s: " + format, self.client_address[0], *args)

    def _refuse(self, code: int, error: str) -> None:
        self.close_connection = True  # an unread body must not be read as the next request
        self._reply(code, {"ok": False, "error": error})

    def _reply(self, code: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
