"""The split between ``make test`` and ``make test-e2e``.

``make test`` runs every unit test and at least one real-process test of every capability, in
under 10 minutes on this project's 2-core machines. The rest of the end-to-end matrix (the same
capability at more world sizes, more fault kinds and moments, slower scenarios) is listed in
``tests/e2e.txt``, one test id (or id prefix) per line; those tests get the ``e2e`` marker,
``make test`` deselects them and ``make test-e2e`` runs them; ``.ci/run`` runs both.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

_LIST = Path(__file__).with_name("e2e.txt")


def _matrix() -> list[str]:
    lines = (ln.split("#", 1)[0].strip() for ln in _LIST.read_text().splitlines())
    return [ln for ln in lines if ln]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: the end-to-end matrix beyond `make test` (tests/e2e.txt)")


@pytest.hookimpl(tryfirst=True)  # before -m / -k deselect anything
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    matrix = _matrix()
    seen: set[str] = set()
    for item in items:
        for entry in matrix:
            if item.nodeid == entry or item.nodeid.startswith((entry + "[", entry + "::")):
                item.add_marker(pytest.mark.e2e)
                seen.add(entry)
    # a stale line is only told apart from a test left out by the command line when whole files ran
    whole_files = not any("::" in arg for arg in config.args)
    collected_all = whole_files and any(item.nodeid.startswith("tests/integration/") for item in items)
    stale = [
        e for e in matrix if e not in seen and e.split("::")[0] in {i.nodeid.split("::")[0] for i in items}
    ]
    if collected_all and stale:
        raise pytest.UsageError(f"tests/e2e.txt names tests that do not exist: {stale}")


@pytest.fixture(autouse=True)
def _no_default_group_left() -> Iterator[None]:
    """A session alone forms a default process group of one and leaves it (as under the launcher,
    where a script may still use it after ``finish``): end it after each in-process test."""
    yield
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# -- the test process's own exit ------------------------------------------------------------------
# The unit tests form gloo groups, stores and torch.distributed's default group inside this process.
# A C++ thread of one (a gloo worker releasing a tensor that a Python object owns) that needs the
# GIL once the interpreter is finalizing is ended by CPython (pthread_exit) inside a noexcept
# destructor: "terminate called without an active exception", exit 134, after every test passed
# (pytorch/pytorch#190489; seen once in CI and once in a fresh clone here). The session ends
# torch.distributed's default group, runs the exit handlers (the library's ``group_works._abort_at_exit``
# among them), then leaves with pytest's status without finalizing the interpreter, as the fork
# server's children do (``launch/forkserver.py``).
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    import atexit
    import os
    import sys

    import torch.distributed as dist

    if not _EXIT_STATUS or getattr(config, "workerinput", None) is not None:
        return
    if _EXIT_STATUS[-1] not in (
        pytest.ExitCode.OK,
        pytest.ExitCode.TESTS_FAILED,
        pytest.ExitCode.NO_TESTS_COLLECTED,
    ):
        return  # interrupted, a usage or internal error: pytest prints why after this hook
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group already broken: the exit below does not need it
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()  # as at a normal exit (the library's among them), the interpreter alive
    os._exit(_EXIT_STATUS[-1])
