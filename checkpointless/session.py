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
import logging
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import torch
import torch.distributed as dist

from checkpointless.comm import CollectiveError, Group
from checkpointless.config import JobConfig
from checkpointless.control.auth import secret_from_env
from checkpointless.control.client import ControlClient, JobStopped, die_with_parent
from checkpointless.ddp import reduce_unbucketed
from checkpointless.durable import DurableWriter
from checkpointless.errors import FatalError, IntegrityError
from checkpointless.faults import FaultInjector
from checkpointless.fsdp import (
    Build,
    Generation,
)
from checkpointless.member import Member, _release_frames
from checkpointless.protocol import keys
from checkpointless.protocol.env import (
    ENV_AGENT_PID,
    ENV_CONFIG,
    ENV_NODE,
    ENV_PROC,
    ENV_RELAY,
    ENV_ROLE,
    ENV_STORE,
)
from checkpointless.protocol.vocab import Event, Phase, Reason, Role
from checkpointless.session_base import Attempt, Between
from checkpointless.state import (
    Stateful,
    combined_digest,
    digest_state,
    entry_digests,
)

if TYPE_CHECKING:
    from torch.utils.data import DataLoader, IterableDataset

    from checkpointless.loaders.iterable_loader import IterableStepLoader
    from checkpointless.loaders.loader import StepLoader

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


def _env_int(name: str) -> int | None:
    """An integer the agent put in the environment, or None where it did not."""
    text = os.environ.get(name, "")
    return int(text) if text.lstrip("-").isdigit() else None


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


class Session(Member):
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

    ``session.process_group`` (read-only) is the current generation's data-parallel group, or None
    outside a launcher, for an integration's own collectives (Lightning's ``self.log(...,
    sync_dist=True)``): a new object after every recovery, so read it at each use.
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
        super().__init__(
            build=build, state=state, seed=seed, reseed_rng=reseed_rng,
            broadcast_buffers=broadcast_buffers, overlap_reduction=overlap_reduction,
        )  # fmt: skip
        if model is not None:
            self._install(model, optimizer, self.state)
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
            elif not dist.is_initialized():
                # a group of one, so that what a DDP script reads (dist.get_rank(),
                # DistributedSampler(dataset), its own all_reduce) runs alone too
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
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
            relay=os.environ.get(ENV_RELAY) or None,
        )
        self._faults = FaultInjector(
            self.job.faults, self._client, node=_env_int(ENV_NODE), agent_pid=_env_int(ENV_AGENT_PID) or 0
        )
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
    def process_group(self) -> Group | None:
        """The current generation's data-parallel process group, or None outside a launcher (a
        sharded model alone: a group of one). Replaced at every recovery: read it at each use."""
        return self._group

    # -- the loop -----------------------------------------------------------------
    def steps(self, total: int, *, start: int = 0) -> Iterator[int]:
        """Yield the step to execute until ``total`` steps are committed.

        A failed step is yielded again after recovery; a replacement starts at
        the step the job is at. ``start``: the step a fresh job begins at, for a script that
        resumes from a snapshot of its own (every rank loads it before the loop, and every rank, a
        replacement too, passes the same ``start``: the first consistency check ends the job naming
        two that differ, and the checks' schedule counts from it). Only a process's first
        ``steps`` call reads it (a script may call ``steps`` once per epoch), and a process that
        already holds a later position (a replacement that received the state) keeps that position.
        """
        if not 0 <= start <= total:
            raise ValueError(f"session.steps({total}, start={start}): start must be between 0 and {total}")
        first = not self._steps_started
        if first:
            self._steps_started = True
            self._first_commit = start
            if start and self._committed < 0 and self._next_step == 0:
                self._committed, self._next_step = start - 1, start
        if self._client is not None:
            # the coordinator checks --fault steps against the total, and the ranks' starts
            self._client.update(
                total=total, **({"start": start, "committed": self._committed} if first else {})
            )
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

    @overload
    def loader(  # type: ignore[overload-overlap]  # an IterableDataset is a Dataset: told apart at run time
        self,
        dataset: IterableDataset[Any],
        global_batch_size: int,
        *,
        shuffle: bool | None = None,
        seed: int | None = None,
        collate_fn: Any = None,
        num_workers: int = 0,
        drop_last: bool = True,
        pin_memory: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
    ) -> IterableStepLoader: ...

    @overload
    def loader(self, dataset: DataLoader[Any]) -> StepLoader | IterableStepLoader: ...

    @overload
    def loader(
        self,
        dataset: Any,
        global_batch_size: int,
        *,
        shuffle: bool | None = None,
        seed: int | None = None,
        collate_fn: Any = None,
        num_workers: int = 0,
        drop_last: bool = True,
        pin_memory: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        order: Callable[[int], Sequence[int]] | None = None,
        epoch_samples: int | None = None,
    ) -> StepLoader: ...

    def loader(
        self,
        dataset: Any,
        global_batch_size: int | None = None,
        *,
        shuffle: bool | None = None,
        seed: int | None = None,
        collate_fn: Any = None,
        num_workers: int = 0,
        drop_last: bool = True,
        pin_memory: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        order: Callable[[int], Sequence[int]] | None = None,
        epoch_samples: int | None = None,
    ) -> StepLoader | IterableStepLoader:
        """This rank's part of every step's global batch of ``dataset``, as a function of the step:
        ``batch = loader.batch(step)`` inside the attempt, in place of a ``DataLoader`` with a
        ``DistributedSampler``. Epochs follow from the step; the global batch does not depend on the
        number of ranks; the iterator (and its worker processes) is kept from step to step and
        restarted only after a recovery; ``worker_init_fn`` runs in each worker process (after the
        loader's own setup). A sample's random transforms (what ``dataset[i]`` draws from ``torch``,
        ``random``, NumPy) are seeded from its place in the job (``checkpointless.loaders.sample_seeds``):
        the same after a recovery and with any number of worker processes.

        A map-style dataset is read by ``StepLoader`` (``checkpointless.loaders.loader``): ``shuffle``
        (default ``True``) draws each epoch's order from ``seed`` (default: the session's);
        ``order(epoch)``, if given, is the epoch's order instead: a permutation of the dataset's
        indices computed from the epoch alone, the same in every process (a length-grouped order, a
        curriculum; a sampler's ``set_epoch`` then ``list(sampler)`` where it draws from a generator
        seeded by the epoch); with ``epoch_samples``, ``order(epoch)`` is that many indices of the
        dataset instead, repeats allowed (a weighted draw with replacement, a subset, an oversampled
        class: ``checkpointless.loaders.sampler_order`` reads a sampler so). A
        ``torch.utils.data.IterableDataset`` is read by ``IterableStepLoader``
        (``checkpointless.loaders.iterable_loader``, whose docstring is the dataset's contract): its
        order is its own, so ``shuffle=True`` is an error and ``seed`` is ignored (a warning).

        ``session.loader(dataloader)``, given the ``DataLoader`` a DDP script built (with its
        ``DistributedSampler``), reads its settings instead (``checkpointless.loaders.from_dataloader``):
        ``batch_size`` per rank, the sampler's ``shuffle`` and ``seed`` (a sampler of another kind:
        its order per epoch, ``sampler_order``), ``collate_fn``, ``num_workers``, ``drop_last``,
        ``pin_memory``, ``worker_init_fn``.

        The keywords are the fields of ``LoaderOptions`` (``checkpointless.loaders.options``, each
        documented there), built once here and handed to the loader."""
        from torch.utils.data import DataLoader

        from checkpointless.loaders.from_dataloader import loader_settings, make_loader
        from checkpointless.loaders.loader import StepLoader
        from checkpointless.loaders.options import LoaderOptions

        options = LoaderOptions(
            shuffle=shuffle, seed=seed, collate_fn=collate_fn, num_workers=num_workers, drop_last=drop_last,
            pin_memory=pin_memory, worker_init_fn=worker_init_fn, order=order, epoch_samples=epoch_samples,
        )  # fmt: skip
        if isinstance(dataset, DataLoader):
            if global_batch_size is not None or options != LoaderOptions():
                raise TypeError("session.loader(dataloader) takes its settings from the DataLoader: "
                                "pass no other arguments (or pass the dataset and global_batch_size)")  # fmt: skip
            dataset, global_batch_size, options = loader_settings(dataset, self.dp_size, self.seed)
        elif global_batch_size is None:
            raise TypeError("session.loader(dataset, global_batch_size): global_batch_size is missing")
        loader = make_loader(dataset, global_batch_size, options, rank=lambda: self.dp_rank,
                             size=lambda: self.dp_size, default_seed=self.seed)  # fmt: skip
        if isinstance(loader, StepLoader):
            loader.check_split(self.dp_size)
        return loader

    def _leave_if_stopped(self) -> None:
        """At a step boundary: if the job was stopped (Ctrl-C, SIGTERM to the launcher), exit now
        instead of training on through the launcher's grace period (the heartbeat thread looks
        for the stop: ``ControlClient.stop_requested``)."""
        client = self._client
        if client is None or not client.stop_requested:
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
            # the CPU generator and CUDA's (torch.manual_seed also looks for other accelerators'
            # at 100x the cost, every step)
            torch.default_generator.manual_seed(s)
            if torch.cuda.is_available():
                torch.cuda.manual_seed_all(s)
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

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[Between]:
        """Work with collectives of its own that every rank does between two steps (an evaluation
        that all-reduces its metrics, a gather for a log line), over the default group
        (``torch.distributed``'s, which the session forms for every generation) or ``process_group``.

        A peer that fails while the block runs (a collective in it fails, or the coordinator
        aborts the generation: a peer died, hung or was cut off) is recovered as in a step: the
        block ends there, ``completed`` stays False, and the loop goes on at the next step in the
        new generation, with a replacement that never runs this block (so nothing in it may be
        training state). An exception of the block's own is raised as usual. Inside the step,
        collectives need no block: a failed attempt is executed again.
        """
        if self._current is not None:
            self._fatal("session.between_steps() used inside `with session.attempt():`")
        block = Between(self._committed)
        try:
            yield block
        except FatalError:
            raise
        except Exception as exc:
            if self._client is None or not self._caused_by_peers(exc):
                raise
            self._on_failure(exc, self._next_step, peers=True, between_steps=True)
            return
        block.completed = True

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
            # on CPU, whether any rank's buffers moved since the last commit rides in the reduction:
            # rank 0's are broadcast then (BatchNorm's statistics, every step), not for a model
            # whose buffers are constant (a transformer's rotary table), every rank agreeing either
            # way; on an accelerator at every step (BufferSync's docstring)
            buffers, group = self._buffers, self._group
            sync = self._broadcast_buffers and bool(buffers) and group is not None and group.world_size > 1
            if sync and self._reducer.flag_on_host:
                moved = not buffers.synced or buffers.changed()
                sync = bool(self._reducer.reduce(group, 1.0 if moved else 0.0))
            else:
                self._reducer.reduce(group)
            if self._reducer.stale():  # unfrozen inside this attempt: reduced apart, this once
                assert self.model is not None
                self._agree_trainable(self._next_step)
                known = {id(p) for p in self._reducer.params}
                extra = [p for p in self.model.parameters() if p.requires_grad and id(p) not in known]
                reduce_unbucketed(extra, self._group)
            if sync:
                buffers.sync(group)
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
            entries = entry_digests(
                {k: v for k, v in self._registry.compared_state_dict().items() if k != "progress"}
            )
            return hashlib.sha256(
                combined_digest(entries) + self._committed.to_bytes(8, "little", signed=True)
            ).hexdigest()
        assert self.model is not None
        return digest_state(self.model, self.optimizer, self._committed)

    def finish(self) -> str:
        """Report the final state and stay available as a recovery source until the job ends.

        Every rank must call it after the loop. Returns the final state digest.
        """
        client = self._client
        if client is not None:
            # done with its loop before the final check: a rank whose loop ended early (its peers
            # still in a step, waiting for it in a collective) is named by the coordinator at once
            client.update(phase=Phase.DONE)
            self._final_check()
        digest = self.state_digest()
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

    def _final_check(self) -> None:
        """The replicas compare their final state, as at a periodic check, unless the loop's last
        check ran at this very step (``_consistency_due``: a function of the committed step, so
        every rank, a replacement too, agrees on it): a replica corrupted since the last check is
        named and re-synced from its shard's majority (the job ends with the majority's state), and
        without a majority the job stops naming which ranks hold which state. A fault inside it is
        recovered as in a step and the check runs again in the new generation, which a replacement
        joins from its own ``finish``."""
        while (
            self._group is not None
            and self.world_size > 1
            and self._committed >= 0
            and not self._consistency_due()
        ):
            try:
                self._check_consistency()
                return
            except (CollectiveError, IntegrityError, TimeoutError) as e:
                self._on_failure(e, self._next_step)

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
            # shipped by the heartbeat thread's next beat (within ``heartbeat_interval``), not here:
            # a store write of the main thread wakes the launcher on the cores the ranks train on,
            # and the step waited for it (~0.2 ms a step, bench/integrations.py). Every event
            # emitted with ``sync`` (a fault's, a failure's) ships the commits before it.
            self._client.emit(
                Event.STEP_COMMITTED, rank=self.rank, gen=self.generation, step=step,
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

    def _at_exit(self) -> None:
        if self._client is None or self._finished:
            return
        # the process ends outside a step (the script raised in its own code, or returned): its
        # last commits, left to the heartbeat thread's next beat, are shipped before it goes
        with contextlib.suppress(RuntimeError, OSError):
            self._client.flush()
        if self._loop_done and not self._fatal_sent:  # a fatal report stands as the reason
            with contextlib.suppress(RuntimeError, OSError):  # the launcher may be gone already
                self._client.report_fatal(
                    self.rank,
                    f"rank {self.rank}: the process exited after its last step without calling "
                    "session.finish() (every rank must call it after the loop)",
                )
