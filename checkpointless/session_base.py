"""What every layer of a session holds (configuration, state, generation) and the helpers each
layer calls: a session is ``Session`` (the user's API, ``session.py``) over ``Member`` (the member
protocol: failure, recovery, joining a generation, ``member.py``) over ``ReplicaConsistency`` (the
replicas' digest check, ``consistency.py``) over ``ModelLifecycle`` (the model installed once, or
built per generation when sharded, ``lifecycle.py``) over ``SessionBase``."""

from __future__ import annotations

import json
import logging
import random
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from checkpointless.comm import Group
from checkpointless.config import JobConfig
from checkpointless.control.client import (
    ControlClient,
)
from checkpointless.ddp import BufferSync, GradientReducer, Trainable
from checkpointless.devices import local_device
from checkpointless.durable import DurableWriter
from checkpointless.errors import FatalError
from checkpointless.fault_grammar import FaultSpec
from checkpointless.faults import FaultInjector
from checkpointless.fsdp import (
    Build,
    Generation,
)
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event
from checkpointless.replicas import own_lineage
from checkpointless.state import (
    Stateful,
    StateRegistry,
    entry_digests,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Attempt:
    """One try of one step, as ``Session.attempt`` yields it.

    ``committed`` becomes True when the block exited normally and the step was
    committed; after a failed attempt it stays False and ``steps()`` yields the
    same step again.
    """

    step: int
    committed: bool = False


@dataclass
class Between:
    """A block of work between two steps, as ``Session.between_steps`` yields it.

    ``after``: the last committed step when it began. ``completed`` becomes True when the block
    ran to its end; it stays False when a peer failed during it (the session recovered and the
    loop goes on at the next step).
    """

    after: int
    completed: bool = False


class _Progress:
    """The session's own transferable state: step counter, data position, RNG states."""

    def __init__(self, session: SessionBase) -> None:
        self._s = session

    def state_dict(self) -> dict[str, Any]:
        return {
            "committed_step": self._s._committed,
            "data_position": self._s._committed + 1,
            # whose computation this state descends from (``replicas.py``): a receiver takes its
            # source's from the transfer; never loaded back (a rollback keeps each rank's own)
            "lineage": self._s._lineage,
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
                # every visible GPU's generator (CPU byte tensors): dropout on the GPU after a
                # recovery draws what it would have drawn without the failure
                **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._s._committed = int(state["committed_step"])
        self._s._next_step = int(state["data_position"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])


class SessionBase:
    """The attributes of a session and the helpers every layer of it uses."""

    job: JobConfig  # the job's configuration (from the launcher; one worker without one)
    _has_state: bool  # whether this process holds valid job state (a spare does not until it receives)
    _secret: bytes  # the job's secret (authenticates control values and state transfers)

    def __init__(
        self,
        *,
        build: Build | None,
        state: dict[str, Stateful] | None,
        seed: int,
        reseed_rng: bool,
        broadcast_buffers: bool,
        overlap_reduction: bool,
    ) -> None:
        self.seed, self.reseed_rng = seed, reseed_rng
        # where this process trains, from its slot on the host: known before a spare has a rank
        self.device: torch.device = local_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._build = build
        self._generation_state: Generation | None = None  # sharded: this generation's groups and mesh
        self._saved: dict[str, Any] | None = None  # sharded: the state carried between generations
        self._broadcast_buffers = broadcast_buffers
        self._overlap = overlap_reduction
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.state: dict[str, Stateful] = dict(state or {})
        self._registry = StateRegistry()
        self._reducer: GradientReducer | None = None
        self._trainable: Trainable | None = None  # replicated: which parameters train
        self._agreed: list[str] | None = None  # the trainable set the ranks last agreed on
        self._lineage = own_lineage(0, 0)  # whose computation this rank's state descends from
        self._lineages: dict[int, int] = {}  # every member's, as last exchanged in a recovery
        self._host_ranks: list[int] = []  # the ranks on this process's host (a host fault hits them all)
        self._buffers = BufferSync(torch.nn.Module())
        self._committed = -1
        self._first_commit = 0  # the first step the job commits (``steps(start=)``)
        self._fatal_sent = False  # this process reported a mistake no recovery can fix (``_fatal``)
        self._steps_started = False  # ``steps`` was called (its first call reads ``start``)
        self._starts: dict[int, int] = {}  # every member's ``steps(start=)``, as last exchanged
        self._next_step = 0
        self._attempted = False
        self._current: Attempt | None = None  # the attempt whose block is running
        self._metrics: dict[str, Any] = {}
        self._reduced = False
        self._reexecute: int | None = None  # the step a recovery resumes at
        self._local_failures = 0
        self._attempts = 0  # attempts started by this process (lets the coordinator see a new try)
        self._group: Group | None = None
        self._loop_done = False
        self._finished = False
        self.rank, self.world_size, self.generation = 0, 1, 0
        self._client: ControlClient | None = None
        self._faults: FaultInjector | None = None
        self._durable: DurableWriter | None = None
        # sharded: a group formation an abort abandoned, and its result (joined at the next one)
        self._forming: tuple[threading.Thread, dict[str, Any]] | None = None

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded (``Session(build=...)``)."""
        return self._build is not None

    @property
    def shard(self) -> int:
        """Which shard of the state this rank holds (0 when the state is replicated)."""
        return self.rank % self.job.shards

    @property
    def replica(self) -> int:
        """Which copy of its shard this rank holds (the rank when the state is replicated)."""
        return self.rank // self.job.shards

    @property
    def _plan_timeout(self) -> timedelta:
        return timedelta(seconds=self.job.recovery.plan_timeout_s)

    def _agree_trainable(self, step: int) -> None:
        """The trainable parameters changed at ``step`` (the loop unfroze or froze one): every rank
        of the generation must have changed them alike; the ranks compare over the store."""
        assert self.model is not None
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        if names == self._agreed:
            return
        if self._client is not None and self.world_size > 1:
            client, gen = self._client, self.generation
            client.publish(keys.trainable(gen, step, self.rank), json.dumps(names))
            timeout = timedelta(seconds=self.job.recovery.collective_timeout_s)
            for r in range(self.world_size):
                try:
                    theirs = client.wait_json(keys.trainable(gen, step, r), timeout)
                except TimeoutError:
                    self._fatal(
                        f"the trainable parameters changed at step {step} on rank {self.rank} but not "
                        f"on rank {r} within {timeout.total_seconds():g} s: every rank must freeze "
                        "or unfreeze the same parameters at the same step"
                    )
                if theirs != names:
                    diff = sorted(set(theirs) ^ set(names))
                    self._fatal(
                        f"the trainable parameters at step {step} differ between rank {self.rank} and "
                        f"rank {r} (first difference: {diff[0] if diff else 'their order'!r})"
                    )
        self._agreed = names

    def _rebuild_reducer(self, step: int, *, agreed: bool = False) -> None:
        """Lay the gradient buckets out anew for the parameters that train now (``agreed``: a
        state transfer set the flags, as on the source)."""
        assert self._reducer is not None and self.model is not None
        if agreed:
            self._agreed = [n for n, p in self.model.named_parameters() if p.requires_grad]
        else:
            self._agree_trainable(step)
        self._reducer.close()
        self._reducer = GradientReducer(list(self.model.parameters()), overlap=self._overlap)
        log.info("[gen %d rank %d step %d] %d trainable parameters: gradient buckets laid out anew",
                 self.generation, self.rank, step, len(self._reducer.params))  # fmt: skip

    def _registered_entries(self) -> list[tuple[str, str]]:
        """Per-entry digests of everything registered (model with buffers, optimizer with its
        ``param_groups``, user state, step and data position) but the per-rank RNG states and
        ``per_rank`` objects: what every replica of a shard must hold alike."""
        state = self._registry.compared_state_dict()
        if "progress" in state:
            state["progress"] = {k: v for k, v in state["progress"].items() if k not in ("rng", "lineage")}
        return entry_digests(state)

    def _fatal(self, message: str) -> None:
        """End the job: report ``message`` (naming this rank) to the coordinator and raise ``FatalError``."""
        text = f"rank {self.rank}: {message}"
        if self._client is not None:
            log.error("[gen %d rank %d] %s", self.generation, self.rank, message)
            self._client.report_fatal(self.rank, text)
            self._fatal_sent = True  # the process's exit must not overwrite it (``Session._at_exit``)
        raise FatalError(text)

    def _fault_fired(self, index: int, fault: FaultSpec, rank: int, step: int) -> None:
        assert self._client is not None
        self._client.emit(
            Event.FAULT_INJECTED, sync=True, rank=rank, gen=self.generation, step=step, index=index,
            fault=fault.kind, ranks=list(fault.ranks) or (self._host_ranks if fault.node is not None else [rank]),
            target=fault.at, node=fault.node,
        )  # fmt: skip
