"""The training session: a re-executable step, failure handling and recovery.

A user's loop keeps its shape::

    session = checkpointless.Session(model, optimizer)
    for step in session.steps(total_steps):
        with session.attempt() as attempt:
            loss = model(*batch_for(step, session.dp_rank, session.dp_size))
            loss.backward()
            session.reduce_gradients()
            optimizer.step()
            optimizer.zero_grad()
            session.log(loss=loss)
        if attempt.committed and session.rank == 0 and step % 100 == 0:
            evaluate()          # runs only after a step that really committed
    session.finish()

Semantics (torchft-style failure as state, STYLE.md 4):

- ``attempt()`` runs one try of the current step. If anything in it raises (a
  collective failed because a peer died, the user's code raised, an injected
  fault), the exception is swallowed, the partial step is discarded and the
  session recovers; ``steps()`` then yields the step to run next, which is the
  failed step again, with the same data and the same RNG seeds. The ``Attempt``
  it yields says whether the step committed: code after the block must look at
  ``attempt.committed`` (a failed attempt leaves the block's variables unset or
  stale).
- The optimizer update must be the last thing in the ``with`` block: a step is
  committed when the block exits normally, and only if ``reduce_gradients`` ran
  in it. ``log`` is only valid inside the block, so a metric is recorded only
  for a step that committed, and the commit record is on the control store
  before the next step starts (a SIGKILL cannot lose it).
- Recovery: destroy the broken group (so peers' pending collectives fail),
  report the last committed step, wait for the coordinator's plan, join the next
  generation's group, send or receive state as the plan says, resume.
- Spares block in ``Session(...)`` until they are given a rank, then receive the
  state and enter the loop at the step the job is at.
- Mistakes no recovery can fix (a step without ``reduce_gradients``, ``log``
  outside the block, parameter shapes that differ between ranks, an exit
  without ``finish``) end the job with a ``FatalError`` naming the rank, instead
  of burning spares.

A sharded model (FSDP2 on a ``replicate x shard`` mesh, HSDP) is given as a factory,
``Session(build=lambda mesh: (model, optimizer))``, called once per generation: the loop reads
``session.model`` / ``session.optimizer`` / ``session.state[...]`` inside the block, FSDP2 reduces
the gradients in ``backward()`` and ``reduce_gradients()`` is a barrier (``fsdp.py`` says how a
generation is built and left).

Without a launcher (no ``CHECKPOINTLESS_STORE`` in the environment) the session
runs as a single process with no fault tolerance, so the same script can be
debugged with plain ``python train.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import gc
import hashlib
import json
import logging
import os
import random
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from checkpointless.comm import CollectiveError, Group, is_collective_failure
from checkpointless.config import JobConfig
from checkpointless.control import keys
from checkpointless.control.auth import pg_token, secret_from_env
from checkpointless.control.client import (
    ENV_CONFIG,
    ENV_PROC,
    ENV_ROLE,
    ENV_STORE,
    ControlClient,
    JobStopped,
    connect,
    die_with_parent,
)
from checkpointless.control.plan import Plan, ReplicaMap
from checkpointless.control.vocab import Event, Phase, Reason, Role
from checkpointless.ddp import BufferSync, GradientReducer, Trainable, reduce_unbucketed
from checkpointless.devices import local_device
from checkpointless.durable import DurableWriter
from checkpointless.durable import load as load_durable
from checkpointless.errors import FatalError
from checkpointless.faults import FaultInjector, FaultSpec
from checkpointless.fsdp import (
    Build,
    Generation,
    ShardedState,
    forget_dtensor_caches,
    fsdp_modules,
    release_formation,
    sockets,
)
from checkpointless.replicas import choose_sources, own_lineage, vote
from checkpointless.state import (
    IntegrityError,
    Stateful,
    StateRegistry,
    combined_digest,
    digest_state,
    entry_digests,
    first_difference,
    recv_state,
    send_state,
)

log = logging.getLogger(__name__)


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of one (step, rank): per-rank RNG is derived, never transferred."""
    h = hashlib.sha256(f"{seed}/{step}/{rank}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def scalar(name: str, value: Any) -> int | float | str | bool:
    """A metric or event value as a JSON scalar (Python, NumPy and one-element tensors convert)."""
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.generic):
        return value.item()  # type: ignore[no-any-return]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"{name}={value!r}: expected a number, a string or a one-element tensor")


def _restore_priority() -> None:
    """Nice 0 for every thread of this process (nice is per thread on Linux). Its scheduling
    autogroup is the launcher's, shared with the workers: left as it is."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
        except OSError as e:  # not allowed (the launcher only nices where it is), or the thread ended
            if e.errno != errno.ESRCH:
                log.warning("could not restore normal priority of thread %d: %s", tid, e)


def _release_frames(exc: BaseException) -> None:
    """Drop the locals of a failure's finished frames (they may hold the broken group's ``Work``)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


def _layout(model: torch.nn.Module) -> list[list[Any]]:
    return [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()] + [
        [n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()
    ]


def _layout_difference(rank_a: int, a: list[list[Any]], rank_b: int, b: list[list[Any]]) -> str:
    """The first difference between two ranks' parameter layouts, in words."""
    by_name_b = {n: (shape, dtype) for n, shape, dtype in b}
    for n, shape, dtype in a:
        if n not in by_name_b:
            return f"parameter {n!r} exists on rank {rank_a} but not on rank {rank_b}"
        if [shape, dtype] != list(by_name_b[n]):
            other = by_name_b[n]
            return (
                f"parameter {n!r} is {tuple(shape)} {dtype} on rank {rank_a} "
                f"but {tuple(other[0])} {other[1]} on rank {rank_b}"
            )
    names_a = {n for n, _, _ in a}
    extra = [n for n, _, _ in b if n not in names_a]
    if extra:
        return f"parameter {extra[0]!r} exists on rank {rank_b} but not on rank {rank_a}"
    return f"parameters are registered in a different order on rank {rank_a} and rank {rank_b}"


@dataclass(slots=True)
class Attempt:
    """One try of one step, as ``Session.attempt`` yields it.

    ``committed`` becomes True when the block exited normally and the step was
    committed; after a failed attempt it stays False and ``steps()`` yields the
    same step again.
    """

    step: int
    committed: bool = False


class _Progress:
    """The session's own transferable state: step counter, data position, RNG states."""

    def __init__(self, session: Session) -> None:
        self._s = session

    def state_dict(self) -> dict[str, Any]:
        return {
            "committed_step": self._s._committed,
            "data_position": self._s._committed + 1,
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


class Session:
    """One process's membership in a fault-tolerant data-parallel job.

    Args:
        model: the module whose gradients are averaged and whose state is moved
            (replicated data parallelism; give ``build`` instead for a sharded model).
        optimizer: its optimizer (state moved with it).
        build: for a sharded model (FSDP2, HSDP): ``build(mesh)`` returns ``(model, optimizer)``
            or ``(model, optimizer, {name: stateful})``, with ``fully_shard(..., mesh=mesh)``
            applied to the model; ``mesh`` is a 2-D ``DeviceMesh`` with dimensions
            ``("replicate", "shard")``. The session calls it once per generation (FSDP2 binds a
            module to its process groups for good), so the loop must use ``session.model``,
            ``session.optimizer`` and ``session.state[name]``, which change after a recovery.
            The model must be built identically (seeded) on every rank; gradients are reduced
            by FSDP2 inside ``backward()``, and every rank reads its own slice of the batch
            (``dp_rank`` is the rank).
        state: more ``Stateful`` objects to move (LR scheduler, data loader, ...);
            they must be identical on every replica.
        seed: base of the per-(step, rank) RNG seeds.
        reseed_rng: reseed torch, numpy and ``random`` at the start of every
            attempt from (seed, step, rank). This makes dropout and any other
            randomness re-executable after a failure; turn it off only if the
            step uses no randomness.
        broadcast_buffers: make every replica's module buffers (BatchNorm
            running statistics, ...) rank 0's at every ``reduce_gradients``, as
            ``DistributedDataParallel``'s default does before every forward
            (``ddp.BufferSync``). Turn it off only for buffers that stay equal
            on every rank by themselves: replicas are compared after the first
            step and every ``recovery.consistency_every`` steps, and a job whose
            replicas differ stops there, naming the entry.
        overlap_reduction: replicated only: all-reduce gradient buckets during
            ``backward()``, as ``DistributedDataParallel`` does (``ddp.GradientReducer``);
            several backward passes per attempt stay correct. The result is the same
            bit for bit either way; turn it off to reduce only in ``reduce_gradients()``.

    ``session.device`` is where this process trains: ``cuda:<slot>`` when the job runs on CUDA
    (``--backend nccl``, or ``--device cuda`` over gloo), else ``cpu``; the slot is the process's
    place on its host (``checkpointless.devices``), given by the launcher before a spare has a
    rank, so ``checkpointless.local_device()`` says it before the session exists: build the
    model there, and put every batch on ``session.device``. The session makes it the current CUDA
    device. Over NCCL the gradients and the state move GPU to GPU; the small messages that steer
    the job (barriers, digests, a transfer's header) run on a gloo group of the same generation.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        build: Build | None = None,
        state: dict[str, Stateful] | None = None,
        seed: int = 0,
        reseed_rng: bool = True,
        broadcast_buffers: bool = True,
        overlap_reduction: bool = True,
    ) -> None:
        if (model is None) == (build is None):
            raise TypeError("Session() takes a model (replicated) or build= (sharded), exactly one of them")
        if build is not None and (optimizer is not None or state):
            raise TypeError(
                "with build=, the optimizer and more state come from build(mesh), not from arguments"
            )
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
        self._stop_checked = 0.0  # when ``steps`` last looked for the job's stop
        self._buffers = BufferSync(torch.nn.Module())
        if model is not None:
            self._install(model, optimizer, self.state)
        self._committed = -1
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
        if build is not None:
            # Every recovery drops a whole model, optimizer and mesh and collects them (cycles),
            # which scans every object of the process: keep what exists before the first
            # build (torch, transformers, the user's data) out of those scans.
            gc.freeze()
        if ENV_STORE not in os.environ:
            self.job = JobConfig(workers=1, spares=0, seed=seed)
            self._has_state = True
            if build is not None:  # one process: a 1 x 1 mesh
                self._generation_state = Generation(
                    dist.HashStore(), gen=0, prefix="local/", rank=0, world=1, shards=1,
                    device_type=self.device.type,
                )  # fmt: skip
                self._group = self._generation_state.group
                self._build_generation()
            return
        die_with_parent()
        self.job = JobConfig.from_json(os.environ[ENV_CONFIG])
        self._secret = secret_from_env()
        rc = self.job.recovery
        self._client = ControlClient(
            os.environ[ENV_STORE],
            os.environ[ENV_PROC],
            self._secret,
            timeout=timedelta(seconds=rc.collective_timeout_s),
            heartbeat_interval=rc.heartbeat_interval_s,
        )
        self._faults = FaultInjector(self.job.faults, self._client)
        if model is not None:
            off = next(((n, t.device) for n, t in model.state_dict().items()
                        if isinstance(t, torch.Tensor) and t.device != self.device), None)  # fmt: skip
            if off is not None:
                self._fatal(
                    f"{off[0]!r} is on {off[1]} but this process trains on {self.device} (session.device): "
                    "build the model on checkpointless.local_device()"
                )
        if rc.durable_every and rc.durable_dir:
            self._durable = DurableWriter.for_job(self.job, self.seed, on_event=self._durable_event)
        atexit.register(self._at_exit)
        # A spare's model is built like the workers' but is not the job's state until it receives it.
        self._has_state = os.environ.get(ENV_ROLE, Role.WORKER) != Role.SPARE
        if not self._has_state:
            if build is not None:
                self._prewarm()
            else:
                self._materialize_optimizer()
            _restore_priority()  # started niced (launcher): start-up is over, a spare must not lag
            self._client.update(phase=Phase.SPARE)
            self._client.emit(Event.SPARE_READY, sync=True)
            try:
                gen = self._client.wait_assignment()
            except JobStopped:
                self._finished = True
                self._client.close()
                raise SystemExit(0) from None
            plan = self._client.wait_plan(gen, self._plan_timeout)
        else:
            plan = self._client.wait_plan(0, self._plan_timeout)
        try:
            self._enter(plan)
        except (CollectiveError, IntegrityError, TimeoutError) as e:
            # a peer failed while this process joined: it stays and recovers like any survivor
            _release_frames(e)
            self._client.emit(Event.FAULT_DETECTED, sync=True, rank=self.rank, gen=plan.gen, step=plan.resume_step,
                              reason=Reason.COLLECTIVE_ERROR, error=str(e)[:300])  # fmt: skip
            self._recover(Reason.COLLECTIVE_ERROR)

    def _install(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Stateful]
    ) -> None:
        """Make ``model``/``optimizer``/``state`` the session's (once; per generation when sharded)."""
        self.model, self.optimizer, self.state = model, optimizer, state
        self._registry = StateRegistry()
        if self._build is None:
            self._registry.register("model", model)
            if optimizer is not None:
                self._registry.register("optimizer", optimizer)
            self._trainable = Trainable(model)
            self._registry.register("trainable", self._trainable)
            self._reducer = GradientReducer(list(model.parameters()), overlap=self._overlap)
        else:
            self._registry.register("model", ShardedState(model, optimizer))
            self._reducer = None  # FSDP2 reduces inside backward()
        for name, obj in state.items():
            self._registry.register(name, obj)
        self._registry.register("progress", _Progress(self))
        self._buffers = BufferSync(model)

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded (``Session(build=...)``)."""
        return self._build is not None

    def _build_generation(self) -> None:
        """Sharded: build this generation's model on its mesh and give it the state carried over."""
        assert self._build is not None and self._generation_state is not None
        built = self._build(self._generation_state.mesh)
        if not isinstance(built, tuple) or len(built) not in (2, 3):
            self._fatal(
                "Session(build=...): build(mesh) must return (model, optimizer) or (model, optimizer, state)"
            )
        model, optimizer = built[0], built[1]
        extra: dict[str, Stateful] = dict(built[2]) if len(built) == 3 else {}  # type: ignore[misc]
        if not fsdp_modules(model):
            self._fatal(
                "Session(build=...): build(mesh) returned a model without fully_shard(..., mesh=mesh)"
            )
        self._install(model, optimizer, extra)
        if self._saved is not None:
            self._registry.load_state_dict(self._saved)
            self._saved = None
            self._buffers.commit()

    def _materialize_optimizer(self) -> None:
        """A spare, while it waits: allocate the optimizer's state (AdamW's moments exist only
        after a first step), so that a recovery's transfer lands in existing tensors instead of
        allocating each one on arrival (which ran the transfer at 0.43x raw gloo). One step on
        zero gradients does it; everything it touched is overwritten by the transfer."""
        if self.optimizer is None or self.optimizer.state or self.model is None:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for p in params:
            p.grad = None

    def _prewarm(self) -> None:
        """A sharded spare builds the model once on a local 1 x 1 mesh while it waits: the first
        build in a process (imports, model classes, FSDP2's first use) takes seconds that a
        recovery would otherwise wait for (measured 2.8-5.6 s for llama-tiny on 2 busy cores,
        0.1 s for a build after that)."""
        assert self._build is not None
        warm = Generation(
            dist.HashStore(), gen=-1, prefix="prewarm/", rank=0, world=1, shards=1,
            device_type=self.device.type,
        )  # fmt: skip
        try:
            built = self._build(warm.mesh)
            del built
        finally:
            warm.close()
            # DTensor's caches hold the warm-up mesh and with it its groups, whose gloo event loops
            # wake up 100 times a second each: an idle spare must not take the CPU from the workers
            forget_dtensor_caches()

    def _leave_generation(self) -> None:
        """Sharded: release the peers, keep this rank's state as plain tensors, drop the model.

        The generation's groups are closed later (``_close_generation``), after the failure is
        reported, so that their cleanup overlaps the coordinator's planning.
        """
        if self._generation_state is not None:
            self._generation_state.release()
        if self.model is not None:
            for m in fsdp_modules(self.model):
                m.reshard()  # a failed forward or backward may have left parameters gathered
            self._buffers.restore()
            if self._has_state:
                self._saved = self._registry.state_dict()
            self.model = self.optimizer = None
            self.state = {}
            self._registry = StateRegistry()
        if self._group is not None:
            self._group.abort()  # the generation's own groups stay for close(); a control group goes
        self._group = None

    def _close_generation(self) -> None:
        if self._generation_state is not None:
            self._generation_state.close()
            self._generation_state = None

    # -- public properties --------------------------------------------------------
    @property
    def step(self) -> int:
        """The step the next attempt executes."""
        return self._next_step

    @property
    def committed_step(self) -> int:
        """The last committed step (-1 before the first commit)."""
        return self._committed

    @property
    def dp_rank(self) -> int:
        """Data-parallel rank: which slice of the global batch this rank reads (every rank reads
        its own, sharded or not: FSDP is data parallel too)."""
        return self.rank

    @property
    def dp_size(self) -> int:
        return self.world_size

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

    # -- the loop -----------------------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        """Yield the step to execute until ``total`` steps are committed.

        A failed step is yielded again after recovery; a replacement starts at
        the step the job is at.
        """
        if self._client is not None:
            self._client.update(total=total)  # the coordinator checks --fault steps against it
        while True:
            if self._consistency_due():  # due before the last step too: checked, then the loop ends
                try:
                    self._check_consistency()
                except (CollectiveError, IntegrityError, TimeoutError) as e:
                    self._on_failure(e, self._next_step)
                    continue
            if self._next_step >= total:
                break
            self._leave_if_stopped()
            self._attempted = False
            yield self._next_step
            if not self._attempted:
                message = "the body of `for step in session.steps(n)` must use `with session.attempt():`"
                if self._client is None:
                    raise RuntimeError(message)
                self._fatal(message)  # the same in every replacement: no spare can fix it
        self._loop_done = True

    def _leave_if_stopped(self) -> None:
        """At a step boundary: if the job was stopped (Ctrl-C, SIGTERM to the launcher), exit now
        instead of training on through the launcher's grace period (checked every 50 ms at most)."""
        client = self._client
        if client is None or time.monotonic() < self._stop_checked + 0.05:
            return
        self._stop_checked = time.monotonic()
        if not client.is_set(keys.JOB_STOP):
            return
        log.warning("[gen %d rank %d] the job was stopped: leaving before step %d", self.generation,
                    self.rank, self._next_step)  # fmt: skip
        if self._durable is not None:
            self._durable.wait()  # a snapshot being written completes
        self._finished = True
        client.close()
        raise SystemExit(0)

    @contextlib.contextmanager
    def attempt(self) -> Iterator[Attempt]:
        """One try of the current step; commits on normal exit, recovers on any exception."""
        step = self._next_step
        current = Attempt(step)
        self._attempted = True
        self._current, self._metrics, self._reduced = current, {}, False
        if self.reseed_rng:
            s = step_seed(self.seed, step, self.rank)
            torch.manual_seed(s)
            np.random.seed(s % 2**32)
            random.seed(s)
        self._attempts += 1
        if self._client is not None:
            self._client.update(phase=Phase.COMPUTE, step=step, attempt=self._attempts)
            if step == self._reexecute:
                self._client.emit(Event.STEP_REEXECUTED, rank=self.rank, gen=self.generation, step=step)
                self._reexecute = None
        if self._reducer is not None:
            if self._reducer.stale():
                self._rebuild_reducer(step)
            self._reducer.begin(self._group)  # the backward pass starts reducing bucket by bucket
        t0 = time.perf_counter()
        try:
            yield current
        except FatalError:
            raise
        except Exception as exc:
            if self._client is None:
                raise
            self._current = None
            self._on_failure(exc, step)
            return
        finally:
            self._current = None
        if self._client is not None and not self._reduced:
            self._fatal(
                f"step {step} ended without session.reduce_gradients(): every rank must reduce once "
                "per attempt, or its peers wait forever in the reduction"
            )
        self._commit(step, time.perf_counter() - t0)
        current.committed = True

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

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without reducing them (as
        ``DistributedDataParallel.no_sync()``): for gradient accumulation, one reduction per
        optimizer step, by the backward pass after the block. Bitwise the same with the overlapped
        reduction on and off. Sharded: FSDP2's ``set_requires_gradient_sync(False)``."""
        if self._current is None:
            self._fatal("session.no_sync() used outside `with session.attempt():`")
        if self._reducer is not None:
            with self._reducer.local():
                yield
            return
        assert self.model is not None
        self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def reduce_gradients(self) -> None:
        """Average gradients across data-parallel ranks. Every rank calls it once per attempt,
        after ``backward()`` and before the optimizer update. Sharded, FSDP2 has reduced them
        already and this is one barrier over the ranks (every rank commits the step, or none).

        Raises ``CollectiveError`` if a peer failed; ``attempt`` handles it.
        """
        if self._current is None:
            self._fatal("session.reduce_gradients() called outside `with session.attempt():`")
        if self._faults is not None:
            self._faults.at_step(self.rank, self._next_step, self._fault_fired, corrupt=self._flip_bit)
        if self._client is not None:
            self._client.update(phase=Phase.REDUCE)
        if self._reducer is not None:
            self._reducer.reduce(self._group)
            if self._reducer.stale():  # unfrozen inside this attempt: reduced apart, this once
                assert self.model is not None
                self._agree_trainable(self._next_step)
                known = {id(p) for p in self._reducer.params}
                extra = [p for p in self.model.parameters() if p.requires_grad and id(p) not in known]
                reduce_unbucketed(extra, self._group)
            if self._broadcast_buffers:
                self._buffers.sync(self._group)
        elif self._group is not None and self._group.world_size > 1:
            # Sharded: FSDP2 reduced the gradients inside backward(), group by group, so a failure
            # there may have spared some ranks. Every rank passes this point or none does: a step
            # then commits everywhere or nowhere (as a DDP reduction makes it), and only the ranks
            # that lost their state receive any (gradient clipping's norm all-reduce, after this,
            # is the one collective left that can split a step). The barrier is a one-number
            # all-reduce that also tells whether any rank's buffers moved since the last commit:
            # rank 0's are broadcast then (and at a generation's first step), not for a model whose
            # buffers are constant (a transformer's rotary table), every rank agreeing either way.
            buffers = self._buffers
            moved = self._broadcast_buffers and bool(buffers) and (not buffers.synced or buffers.changed())
            flag = torch.tensor([1.0 if moved else 0.0])
            self._group.control.allreduce_([flag])
            if flag.item() > 0:
                buffers.sync(self._group)
        self._reduced = True

    def log(self, **metrics: Any) -> None:
        """Attach metrics (``loss``, ``tokens``, ...) to the current step's commit record.

        Only valid inside ``with session.attempt():``, so that a value is recorded
        for a step only if that step commits. Numbers, strings, NumPy scalars and
        one-element tensors are accepted.
        """
        if self._current is None:
            self._fatal(
                "session.log() called outside `with session.attempt():` (after a failed attempt it "
                "would record the values of a step that did not commit); move it into the block"
            )
        try:
            self._metrics.update({k: scalar(k, v) for k, v in metrics.items()})
        except TypeError as e:
            self._fatal(f"session.log(): {e}")

    def emit(self, kind: str, **fields: Any) -> None:
        """Record a custom event (for example ``eval`` with ``heldout_loss``) at the committed step."""
        event: dict[str, Any] = {"rank": self.rank, "gen": self.generation, "step": self._committed}
        try:
            event.update({k: scalar(k, v) for k, v in fields.items()})
        except TypeError as e:
            self._fatal(f"session.emit({kind!r}): {e}")
        if self._client is not None:
            self._client.emit(kind, **event)

    def state_digest(self) -> str:
        """SHA-256 of model, optimizer state and committed step (see ``digest_state``); sharded:
        of this rank's shard (equal on every replica of the shard)."""
        if self.sharded:
            entries = entry_digests({k: v for k, v in self._registry.state_dict().items() if k != "progress"})
            return hashlib.sha256(
                combined_digest(entries) + self._committed.to_bytes(8, "little", signed=True)
            ).hexdigest()
        assert self.model is not None
        return digest_state(self.model, self.optimizer, self._committed)

    def _registered_entries(self) -> list[tuple[str, str]]:
        """Per-entry digests of everything registered (model with buffers, optimizer with its
        ``param_groups``, user state, step and data position) but the per-rank RNG states:
        what every replica of a shard must hold alike."""
        state = self._registry.state_dict()
        if "progress" in state:
            state["progress"] = {k: v for k, v in state["progress"].items() if k != "rng"}
        return entry_digests(state)

    def finish(self) -> str:
        """Report the final state and stay available as a recovery source until the job ends.

        Every rank must call it after the loop. Returns the final state digest.
        """
        digest = self.state_digest()
        client = self._client
        if self._durable is not None:
            self._durable.wait()  # a snapshot still being written completes before the job ends
        if client is None:
            self._finished = True
            return digest
        client.update(phase=Phase.DONE)
        entries = self._registered_entries()
        client.report_done(self.rank, digest, self._committed, entries)
        last_report = time.monotonic()
        while True:
            if client.is_set(keys.JOB_STOP):
                break
            if client.is_set(keys.abort(self.generation)):
                self._recover(Reason.PEER_FAILURE)
                digest = self.state_digest()
                entries = self._registered_entries()
                client.update(phase=Phase.DONE)
                client.report_done(self.rank, digest, self._committed, entries)
                continue
            if time.monotonic() - last_report > 1.0:  # a forged overwrite must not hide our report
                client.report_done(self.rank, digest, self._committed, entries)
                last_report = time.monotonic()
            time.sleep(0.02)
        self._finished = True
        client.close()
        return digest

    # -- replica consistency -------------------------------------------------
    def _flip_bit(self) -> None:
        """The ``corrupt`` fault: flip the lowest bit of the first element of the first parameter."""
        assert self.model is not None
        local = (
            [t for t in self._registry.state_dict()["model"]["params"].values()]
            if self.sharded
            else list(self.model.parameters())
        )
        p = next(p for p in local if p.numel())
        with torch.no_grad():
            p.view(-1)[:1].view(torch.uint8)[:1].bitwise_xor_(1)

    def _consistency_due(self) -> bool:
        """Whether the replicas compare their state before the next step: a function of the
        committed step only, so that every rank of a generation agrees (a replacement too)."""
        c = self._committed
        if self._client is None or self._group is None or self.world_size < 2 or c < 0:
            return False
        every = self.job.recovery.consistency_every
        return c == 0 or (every > 0 and (c + 1) % every == 0)

    def _exchange_digests(
        self, digest: bytes | None, *, holder: bool
    ) -> tuple[dict[int, bytes], dict[int, int], set[int]]:
        """One all-gather of every member's state digest (zeros without one), lineage and whether
        it holds its state in this exchange: by rank, digests, lineages and the holders."""
        assert self._group is not None
        payload = (digest or bytes(32)) + self._lineage.to_bytes(8, "little") + bytes([1 if holder else 0])
        mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows = [bytes(t.tolist()) for t in self._group.control.allgather(mine)]
        digests = {r: row[:32] for r, row in enumerate(rows)}
        lineages = {r: int.from_bytes(row[32:40], "little") for r, row in enumerate(rows)}
        return digests, lineages, {r for r, row in enumerate(rows) if row[40]}

    def _wait_peer_json(self, key: str) -> Any:
        """A value a peer of this generation publishes, or ``CollectiveError`` as soon as the
        coordinator aborts the generation (a peer died): every wait inside a step becomes a
        normal recovery, never a wait for ``plan_timeout_s``."""
        assert self._client is not None
        outcome = self._poll_abort(self._plan_timeout.total_seconds(), until=key)
        if outcome is None:
            raise TimeoutError(f"{key} was not published within {self._plan_timeout.total_seconds():g} s")
        if outcome:
            raise CollectiveError(f"gen {self.generation}: aborted while waiting for {key}")
        return self._client.wait_json(key, self._plan_timeout)

    def _poll_abort(self, seconds: float, until: str | None = None) -> bool | None:
        """Poll the store until this generation is aborted (True), ``until`` is published (False)
        or ``seconds`` pass (None)."""
        assert self._client is not None
        client, deadline = self._client, time.monotonic() + seconds
        while time.monotonic() < deadline:
            if until is not None and client.is_set(until):
                return False
            if client.is_set(keys.abort(self.generation)):
                return True
            time.sleep(0.005)
        return None

    def _check_consistency(self) -> None:
        """Compare a digest of every replica's state (one 32-byte all-gather); act on a difference.

        The state is the registered one (model with its buffers, optimizer, user state) at the
        committed step, without the per-rank RNG state; a sharded job compares the replicas of
        each shard. After the first step a difference is a program error (state each rank
        updates from its own batch): the job stops naming the entry. Later it is corruption: the
        replicas that differ from a strict majority of their shard's replicas receive the state
        of the majority's lowest rank; without a majority the job stops.
        """
        assert self._client is not None and self._group is not None
        client, group, step = self._client, self._group, self._committed
        if self._faults is not None:
            self._faults.at_check(self.rank, step + 1, self._fault_fired)
        entries = self._registered_entries()
        digests, lineages, _ = self._exchange_digests(combined_digest(entries), holder=True)
        layout = ReplicaMap(self.world_size, self.job.shards)
        replica_groups = [layout.replica_group(shard) for shard in range(self.job.shards)]
        if all(len({digests[r] for r in ranks}) == 1 for ranks in replica_groups):
            self._lineage = own_lineage(self.generation, self.rank)  # verified: independent again
            return
        if self._faults is not None:
            self._faults.at_check(self.rank, step + 1, self._fault_fired, at="digests")
        client.publish(keys.state_digests(self.generation, step, self.rank), json.dumps(entries))
        by_rank = {
            r: [(str(p), str(d)) for p, d in self._wait_peer_json(keys.state_digests(self.generation, step, r))]
            for r in range(self.world_size)
        }  # fmt: skip
        resyncs: list[tuple[int, list[int], str | None]] = []
        for ranks in replica_groups:
            result = vote(ranks, digests, lineages)  # copies of one source are one vote
            if result.agreed:
                continue
            healthy, odd = result.healthy, result.odd
            ref = healthy[0] if healthy else ranks[0]
            other = next(r for r in ranks if digests[r] != digests[ref])
            entry = first_difference(by_rank[ref], by_rank[other])
            where = f"{entry!r} differs between rank {ref} and rank {other}"
            if self.job.shards > 1:
                where += f" (replicas of shard {layout.shard_of(ref)})"
            if self.rank == min(healthy or ranks):
                client.emit(Event.STATE_DIVERGED, sync=True, rank=self.rank, gen=self.generation, step=step,
                            entry=str(entry), ranks=odd, healthy=healthy)  # fmt: skip
            if step == 0:
                self._fatal(
                    f"replicas differ after the first step: {where}. Every replica must hold the same "
                    "state; state each rank updates from its own batch (BatchNorm running statistics) "
                    "needs Session(broadcast_buffers=True), the default"
                )
            if not healthy:
                self._fatal(
                    f"replicas differ at step {step} and no majority tells which is right: {where} "
                    "(silent data corruption, or a non-deterministic update); stopping rather than "
                    "training on a state that may be corrupt"
                )
            resyncs.append((ref, odd, entry))
        for ref, odd, entry in resyncs:
            if self.rank == ref:
                for dst in odd:
                    send_state(group, dst, self._registry.state_dict(), key=self._secret)
            elif self.rank in odd:
                self._has_state = False
                state, stats = recv_state(group, ref, key=self._secret, into=self._registry.state_dict())
                self._registry.load_state_dict(state)
                self._has_state = True
                self._lineage = lineages[ref]
                self._buffers.commit()
                if self._reducer is not None and self._reducer.stale():  # the majority's flags
                    self._rebuild_reducer(step + 1, agreed=True)
                client.emit(Event.STATE_RESYNCED, sync=True, rank=self.rank, gen=self.generation, step=step,
                            src=ref, entry=str(entry), bytes=stats.bytes, seconds=stats.seconds)  # fmt: skip
        group.barrier()

    # -- commit and failure ----------------------------------------------------
    def _commit(self, step: int, seconds: float) -> None:
        self._buffers.commit()
        if self._trainable is not None:
            self._trainable.commit()
        self._committed = step
        self._next_step = step + 1
        self._local_failures = 0
        if self._client is not None:
            self._client.update(phase=Phase.IDLE, committed=step, step_time_s=seconds, **self._metrics)
            self._client.emit(
                Event.STEP_COMMITTED, sync=True, rank=self.rank, gen=self.generation, step=step,
                step_time_s=seconds, **self._metrics,
            )  # fmt: skip
            durable = self._durable
            if durable is not None and durable.due(step) and self.replica == 0:  # one writer per shard
                durable.shard = self.shard
                if durable.save(step, self._registry.state_dict()):
                    self._client.emit(
                        Event.DURABLE_SAVED, rank=self.rank, gen=self.generation, step=step, shard=self.shard
                    )

    def _durable_event(self, kind: str, fields: dict[str, Any]) -> None:
        """A durable snapshot written, failed or skipped (from its writer thread): shipped at once."""
        if self._client is not None:
            self._client.emit(kind, sync=True, rank=self.rank, gen=self.generation, **fields)

    def _fatal(self, message: str) -> None:
        """End the job: report ``message`` (naming this rank) to the coordinator and raise ``FatalError``."""
        text = f"rank {self.rank}: {message}"
        if self._client is not None:
            log.error("[gen %d rank %d] %s", self.generation, self.rank, message)
            self._client.report_fatal(self.rank, text)
        raise FatalError(text)

    def _at_exit(self) -> None:
        if self._client is None or self._finished:
            return
        if self._loop_done:
            with contextlib.suppress(RuntimeError, OSError):  # the launcher may be gone already
                self._client.report_fatal(
                    self.rank,
                    f"rank {self.rank}: the process exited after its last step without calling "
                    "session.finish() (every rank must call it after the loop)",
                )

    def _fault_fired(self, index: int, fault: FaultSpec, rank: int, step: int) -> None:
        assert self._client is not None
        self._client.emit(
            Event.FAULT_INJECTED, sync=True, rank=rank, gen=self.generation, step=step, index=index,
            fault=fault.kind, ranks=list(fault.ranks) or [rank], target=fault.at,
        )  # fmt: skip

    def _caused_by_peers(self, exc: Exception) -> bool:
        """Whether a failed step is a collective failure, by its cause, not its message: our own
        group operations raise ``CollectiveError``; an error raised inside a library's collective
        (FSDP2's all-gather: a bare ``RuntimeError`` naming gloo) counts only if the generation was
        aborted (a peer died or failed: the coordinator aborts it within its detection time).
        Anything else the step raised is the user's exception, re-executed a bounded number of times."""
        if isinstance(exc, CollectiveError):
            return True
        if not is_collective_failure(exc) or self._client is None:
            return False
        rc = self.job.recovery
        return self._poll_abort(rc.hang_timeout_s + 4 * rc.heartbeat_interval_s) is True

    def _on_failure(self, exc: Exception, step: int) -> None:
        _release_frames(exc)
        reason = Reason.COLLECTIVE_ERROR if self._caused_by_peers(exc) else Reason.EXCEPTION
        if reason == Reason.EXCEPTION:
            self._local_failures += 1
            if self._local_failures > self.job.recovery.max_retries_per_step:
                self._fatal(f"step {step} raised {self._local_failures} times in a row: {exc!r}")
        log.warning(
            "[gen %d rank %d step %d] step failed (%s): %s", self.generation, self.rank, step, reason, exc
        )
        assert self._client is not None
        self._client.emit(
            Event.FAULT_DETECTED, sync=True, rank=self.rank, gen=self.generation, step=step,
            reason=reason, error=str(exc)[:300],
        )  # fmt: skip
        del exc
        self._recover(reason)

    def _recover(self, reason: str) -> None:
        """Leave the broken generation and enter the next one (loops if that one fails too)."""
        assert self._client is not None
        while True:
            if self.sharded:
                self._leave_generation()
            else:
                assert self._reducer is not None
                self._reducer.abandon()  # its collectives still in flight write into dropped buckets
                if self._group is not None:
                    self._group.abort()
                    self._group = None
                self._buffers.restore()  # the failed attempt's forward pass updated them in place
                if self._trainable is not None:
                    self._trainable.restore()
            self._client.update(phase=Phase.RECOVERING)
            self._client.report_failure(self.generation, self.rank, self._committed, reason, self._has_state)
            self._close_generation()  # sharded: overlaps the coordinator's planning
            plan = self._client.wait_plan(self.generation + 1, self._plan_timeout)
            try:
                self._enter(plan)
                return
            except (CollectiveError, IntegrityError, TimeoutError) as e:
                _release_frames(e)
                reason = Reason.COLLECTIVE_ERROR
                log.warning("[gen %d rank %d] recovery failed: %s", plan.gen, self.rank, e)
                self._client.emit(
                    Event.FAULT_DETECTED, sync=True, rank=self.rank, gen=plan.gen, step=self._committed + 1,
                    reason=reason, error=str(e)[:300],
                )  # fmt: skip

    def _form_group(self, plan: Plan) -> Group:
        """Build the generation's group in a helper thread, giving up if the coordinator aborts it.

        The helper uses a store connection of its own: if it is abandoned (a peer
        died during formation) it may stay blocked in a store call until the
        collective timeout, and the main thread must still be able to report.
        """
        assert self._client is not None
        client = self._client
        result: dict[str, Any] = {}
        timeout = timedelta(seconds=self.job.recovery.collective_timeout_s)
        prefix = keys.pg_prefix(plan.gen, pg_token(self._secret, plan.gen))

        if self._forming is not None:
            # a sharded formation abandoned by an abort: the default group is global, so it must
            # end (it fails at the latest at the collective timeout) before the next one starts
            stale, stale_result = self._forming
            stale.join(timeout.total_seconds() + 5)
            if stale.is_alive():
                self._fatal(f"a group formation abandoned before generation {plan.gen} did not end")
            if "generation" in stale_result:
                stale_result["generation"].close()
            self._forming = None

        def form() -> None:
            try:
                store = connect(client.addr, timeout)
                if self.sharded:
                    result["generation"] = Generation(
                        store, gen=plan.gen, prefix=prefix, rank=self.rank, world=plan.world_size,
                        shards=plan.shards, backend=self.job.backend, timeout=timeout,
                        device_type=self.device.type,
                    )  # fmt: skip
                    if self.job.backend != "gloo":  # the control messages' gloo group (comm.Group)
                        result["generation"].group.control = Group(
                            store, plan.gen, self.rank, plan.world_size, prefix=prefix + "ctl/",
                            timeout=timeout,
                        )  # fmt: skip
                else:
                    result["group"] = Group(
                        store, plan.gen, self.rank, plan.world_size, prefix=prefix,
                        backend=self.job.backend, timeout=timeout,
                    )  # fmt: skip
            except (RuntimeError, OSError, TimeoutError) as e:  # the store or a peer failed
                result["error"] = f"{type(e).__name__}: {e}"
            except Exception as e:  # a bug, not a peer: no recovery fixes it
                result["fatal"] = f"{type(e).__name__}: {e}"

        before = sockets()
        t = threading.Thread(target=form, name=f"form-gen-{plan.gen}", daemon=True)
        t.start()
        while t.is_alive():
            t.join(timeout=0.01)
            if t.is_alive() and client.is_set(keys.abort(plan.gen)):
                # The helper waits on a peer that will never come (up to the collective timeout).
                # Shut down the connections it opened (its store connection, those its group's
                # listener accepted; not what other threads opened meanwhile): its
                # wait fails now, and a sharded formation, which holds the process's one default
                # group, ends before the next one starts (a fresh spare in the next generation
                # would otherwise wait for this rank in vain, and time out in turn)
                release_formation(before, client.addr)
                t.join(timeout=5.0)
                if self.sharded and t.is_alive():
                    self._forming = (t, result)
                elif "generation" in result:  # formed just as the abort came
                    result["generation"].close()
                raise CollectiveError(f"gen {plan.gen}: aborted by the coordinator during group formation")
        if "fatal" in result:
            self._fatal(f"forming generation {plan.gen}'s process group failed: {result['fatal']}")
        if "error" in result:
            raise CollectiveError(str(result["error"]))
        if self.sharded:
            self._generation_state = result["generation"]
            return self._generation_state.group
        group: Group = result["group"]
        return group

    def _restore_durable(self, plan: Plan) -> Plan:
        """Every rank rolls back to its run's newest durable snapshot, at or before the plan's step,
        that every rank can load; returns the plan as followed (resuming after that snapshot).

        Each rank loads the newest snapshot of its shard that verifies at or before the bound
        (``durable.load``: a flipped byte, a file gone or another run's are skipped, with a warning
        line and, from dp-rank 0 of the shard, a ``durable_failed`` event); one all-gather of the
        steps loaded, and the smallest becomes the bound, until every rank loaded the same step.
        None left: the job stops, in one line.
        """
        from dataclasses import replace

        assert self._client is not None and self._group is not None and plan.restore is not None
        writer = self._durable
        assert writer is not None  # a rollback is planned only with the tier on
        writer.wait()  # this process's own save may still be writing
        self._has_state = False
        bound, mine, bad, why = plan.restore, -1, set(), []
        while True:
            if mine != bound:
                mine = -1
                for step in writer.candidates(plan.shards, at_most=bound):
                    if step in bad:
                        continue
                    try:
                        state = load_durable(writer.root, step, self.shard, writer.run)
                    except IntegrityError as e:
                        bad.add(step)
                        why.append(str(e))
                        log.warning("[gen %d rank %d] durable snapshot not used, trying an older one: %s",
                                    plan.gen, self.rank, e)  # fmt: skip
                        if self.replica == 0:
                            self._client.emit(Event.DURABLE_FAILED, sync=True, rank=self.rank, gen=plan.gen,
                                              step=step, shard=self.shard, during="restore", error=str(e)[:300])  # fmt: skip
                        continue
                    self._registry.load_state_dict(state)
                    mine = step
                    break
            steps = [int(t) for t in self._group.control.allgather(torch.tensor([mine], dtype=torch.int64))]
            if min(steps) < 0:
                skipped = ", ".join(map(str, sorted(bad, reverse=True))) or "none here"
                self._fatal(
                    f"cannot roll back to a durable snapshot: none of this run at or before step {plan.restore} "
                    f"verifies on every rank (skipped on this rank: {skipped}{'; ' + why[0][:250] if why else ''})"
                )
            if len(set(steps)) == 1:
                break
            bound = min(steps)
        self._buffers.commit()
        self._has_state = True
        self._client.emit(Event.DURABLE_RESTORED, sync=True, rank=self.rank, gen=plan.gen, step=mine)
        return plan if mine == plan.restore else replace(plan, restore=mine, resume_step=mine + 1)

    def _check_layout(self, plan: Plan) -> None:
        """Every rank's parameters must have the same names, shapes and dtypes (one tiny all-gather)."""
        assert self._client is not None and self._group is not None
        assert self.model is not None
        mine = _layout(self.model)
        text = json.dumps(mine)
        self._client.publish(keys.layout(plan.gen, self.rank), text)
        digest = torch.frombuffer(bytearray(hashlib.sha256(text.encode()).digest()), dtype=torch.uint8)
        digests = self._group.control.allgather(digest)
        if all(torch.equal(d, digests[0]) for d in digests):
            return
        layouts = {r: self._client.read_json(keys.layout(plan.gen, r)) for r in range(plan.world_size)}
        odd = next(r for r in range(1, plan.world_size) if not torch.equal(digests[r], digests[0]))
        self._fatal(
            "model layouts differ between ranks: " + _layout_difference(0, layouts[0], odd, layouts[odd])
        )

    def _compare_holders(self, plan: Plan, digest: bytes | None, holder: bool) -> dict[int, int]:
        """The holders of each shard compare their state before any is copied; where they
        disagree, the majority of lineages is the source (and re-syncs the odd holders), and
        without a majority the job stops rather than copy a state that may be corrupt."""
        assert self._client is not None
        digests, lineages, holders = self._exchange_digests(digest, holder=holder)
        self._lineages = lineages
        layout = ReplicaMap(plan.world_size, plan.shards)
        groups = [layout.replica_group(shard) for shard in range(plan.shards)]
        sources, split = choose_sources(plan.sources, groups, holders, digests, lineages)
        step = plan.resume_step - 1
        for ranks, result in split:
            held = sorted(r for r in ranks if r in holders)
            if self.rank == min(held):
                self._client.emit(Event.STATE_DIVERGED, sync=True, rank=self.rank, gen=plan.gen, step=step,
                                  entry="(at recovery)", ranks=result.odd, healthy=result.healthy)  # fmt: skip
            if not result.healthy:
                of = f" of shard {layout.shard_of(ranks[0])}" if plan.shards > 1 else ""
                self._fatal(
                    f"at recovery the replicas{of} that kept their state differ (ranks {held}) and no "
                    "majority of independent copies tells which is right (silent data corruption?): "
                    "stopping rather than copying a state that may be corrupt"
                )
        if sources != plan.sources:
            log.warning("[gen %d rank %d] replicas disagreed at recovery: sources %s instead of %s",
                        plan.gen, self.rank, sources, plan.sources)  # fmt: skip
        return sources

    def _enter(self, plan: Plan) -> None:
        """Join ``plan``'s generation: form its group, check layouts and move state as it says."""
        assert self._client is not None
        client = self._client
        rank = plan.rank_of(client.proc)
        assert rank is not None, f"{client.proc} is not a member of generation {plan.gen}"
        self.rank, self.world_size, self.generation = rank, plan.world_size, plan.gen
        client.update(rank=rank, gen=plan.gen, phase=Phase.JOINING)
        self._lineages = {}
        if self._faults is not None and rank in plan.replaced:
            self._faults.at_recovery(rank, plan.resume_step, self._fault_fired, at="join")
        if plan.shards > 1 and not self.sharded:
            self._fatal(
                f"the job has {plan.shards} shards per replica (--shards / parallel.shards) but "
                "Session(model) replicates the model: shard it with Session(build=...)"
            )
        if plan.gen == 0:
            self._lineage = own_lineage(0, rank)
        # where a recovery copies state, the holders compare theirs first (corruption since the
        # last check must not be copied): hashed here, overlapping the group's formation
        compare = (
            plan.gen > 0 and bool(plan.sources) and plan.restore is None and plan.world_size > 1
            and self.job.recovery.consistency_every > 0
        )  # fmt: skip
        holder = self._has_state and rank not in plan.sources
        hashing: dict[str, bytes] = {}
        hasher = None
        if compare and holder and not self.sharded:
            hasher = threading.Thread(
                target=lambda: hashing.update(d=combined_digest(self._registered_entries())), daemon=True
            )
            hasher.start()
        self._group = self._form_group(plan)
        if self.sharded:
            self._build_generation()
        if plan.world_size > 1:
            self._check_layout(plan)
        if plan.restore is not None:
            plan = self._restore_durable(plan)
        sources = dict(plan.sources)
        if compare:
            if hasher is not None:
                hasher.join()
            elif holder:
                hashing["d"] = combined_digest(self._registered_entries())
            sources = self._compare_holders(plan, hashing.get("d"), holder)
        if rank in sources:
            src = sources[rank]
            client.emit(Event.TRANSFER_BEGUN, rank=rank, gen=plan.gen, step=plan.resume_step, src=src)

            def hook() -> None:
                # kill:spare@recovery hits a replacement only, never a lagging survivor that receives
                if self._faults is not None and rank in plan.replaced:
                    self._faults.at_recovery(rank, plan.resume_step, self._fault_fired)

            # received in place, into this process's own tensors: it holds no valid state until loaded
            self._has_state = False
            mine = self._registry.state_dict()
            state, stats = recv_state(self._group, src, between=hook, key=self._secret, into=mine)
            del mine
            self._registry.load_state_dict(state)
            self._buffers.commit()
            self._has_state = True
            self._lineage = self._lineages.get(src, own_lineage(plan.gen, src))
            client.emit(
                Event.TRANSFER_ENDED, rank=rank, gen=plan.gen, step=plan.resume_step, src=src,
                bytes=stats.bytes, seconds=stats.seconds, waited_s=round(stats.waited_s, 4), sha256_ok=True,
            )  # fmt: skip
        for dst in sorted(r for r, s in sources.items() if s == rank):
            if self._faults is not None:
                self._faults.at_recovery(rank, plan.resume_step, self._fault_fired, at="source")
            stats = send_state(self._group, dst, self._registry.state_dict(), key=self._secret)
            log.info(
                "[gen %d rank %d] sent %d bytes to rank %d in %.3fs", plan.gen, rank, stats.bytes, dst,
                stats.seconds,
            )  # fmt: skip
        if self._reducer is not None and self._reducer.stale():  # the flags came with the state
            self._rebuild_reducer(plan.resume_step, agreed=True)
        assert self._committed == plan.resume_step - 1, (self._committed, plan.resume_step)
        self._next_step = plan.resume_step
        self._reexecute = plan.resume_step if plan.gen > 0 else None
        client.update(phase=Phase.IDLE, committed=self._committed)
