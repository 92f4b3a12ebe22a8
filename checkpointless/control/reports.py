"""The members' failure reports, as the coordinator reads them.

A member that leaves a failed generation reports its committed step and whether it holds its
state: a process that beats into the control store itself writes a sealed ``keys.fail`` value,
bumps the counter ``keys.fail_count`` and appends its rank to the list ``keys.fail_ranks``; a
relayed process's report rides its heartbeat. The counter and the list are hints (anyone who
reaches the store can bump a counter, list the keys and write a list): they say which sealed
reports to open, and a forged or cut list only delays the reports to the coordinator's deadline
for members that neither die nor report.
"""

from __future__ import annotations

import json
from typing import Any

from checkpointless.control.auth import SignedStore
from checkpointless.protocol import keys


class FailureReports:
    """Reads generation ``gen``'s failure reports (see the module docstring)."""

    def __init__(self, store: SignedStore) -> None:
        self._store = store
        self._relayed: list[tuple[str, dict[str, Any]]] = []  # (process, report) not judged yet

    def relayed(self, name: str, report: dict[str, Any]) -> None:
        """A report that came in process ``name``'s heartbeat (``ControlClient.report_failure``)."""
        self._relayed.append((name, report))

    @property
    def waiting(self) -> bool:
        """Whether relayed reports wait to be judged."""
        return bool(self._relayed)

    def take_relayed(self) -> list[tuple[str, dict[str, Any]]]:
        """The relayed reports since the last call: (process, report)."""
        out, self._relayed = self._relayed, []
        return out

    def read(self, gen: int, members: dict[int, str], known: set[int]) -> list[tuple[int, dict[str, Any]]]:
        """The verified reports written to the store by members not in ``known`` (rank, report), in
        the order their ranks were listed."""
        if self._store.add(keys.fail_count(gen), 0) == 0:
            return []  # the counter is only a hint (anyone can bump it): the sealed reports decide
        ranks = [r for r in self._listed(gen, members) if r not in known]
        texts = self._read(gen, ranks)
        return [(r, json.loads(texts[r])) for r in ranks if r in texts]

    def _listed(self, gen: int, members: dict[int, str]) -> list[int]:
        """The members the list ``keys.fail_ranks`` names (each member appends its rank after its
        sealed report): the reports to read, not every member's key every tick (16,000 round trips
        at 2,000 hosts)."""
        name = self._store.name(keys.fail_ranks(gen))
        if not self._store.raw.check([name]):
            return []
        out: dict[int, None] = {}  # in the order listed, once each (a list's ``in`` was quadratic in
        # the reports: most of the coordinator's loop at scale, bench/control_scale.py)
        for word in bytes(self._store.raw.get(name)).decode(errors="replace").split(","):
            if word.strip().isdigit() and int(word) in members:
                out[int(word)] = None
        return list(out)

    def _read(self, gen: int, ranks: list[int]) -> dict[int, str]:
        """The verified reports of ``ranks``: in one round trip when every key exists (as the list
        promises), else key by key."""
        names = [keys.fail(gen, r) for r in ranks]
        if not names:
            return {}
        if self._store.raw.check([self._store.name(n) for n in names]):
            raws = self._store.get_sealed_present(names)
            texts = {r: self._store.open(n, raw) for r, n, raw in zip(ranks, names, raws, strict=True)}
        else:
            texts = {r: self._store.get(n) for r, n in zip(ranks, names, strict=True)}
        return {r: t for r, t in texts.items() if t is not None}
