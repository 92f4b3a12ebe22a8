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

An attempt that raises (a peer died, the user's code raised, an injected fault) is discarded and
the session recovers; ``steps()`` then yields the same step again, with the same data and seeds. A
spare blocks in ``Session(...)`` until it is given a rank. Mistakes no recovery can fix end the job
with a ``FatalError`` naming the rank. Without a launcher the script runs alone, without fault
tolerance. The user guide's session page says the rules; ``Session`` holds the parts that keep
them (``progress.py``, ``model_holder.py``, ``member.py``, ``consistency.py``, ``ending.py``), and
those that run its loop (``step_loop.py``: the steps, their attempts and the reduction;
``commit.py``: the commit and what was logged for it; ``seeds.py``: the RNG of a step).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

import torch

from checkpointless.comm import Group
from checkpointless.commit import StepCommit, scalar
from checkpointless.config import JobConfig
from checkpointless.consistency import ReplicaCheck
from checkpointless.control.client import die_with_parent
from checkpointless.devices import local_device
from checkpointless.ending import Ending
from checkpointless.errors import FatalError
from checkpointless.fsdp import Build
from checkpointless.joining import member_of_the_job, start_alone, start_as_spare, start_as_worker
from checkpointless.model_holder import ModelHolder, ReplicatedModel
from checkpointless.notice import Notice
from checkpointless.progress import Attempt, Between, Progress, StepState
from checkpointless.protocol.env import (
    ENV_CONFIG,
    ENV_ROLE,
    ENV_STORE,
)
from checkpointless.protocol.vocab import Role
from checkpointless.seeds import Seeds, step_seed
from checkpointless.sharded_model import ShardedModel
from checkpointless.share_loop import ShareLoop, held_by
from checkpointless.state import Stateful
from checkpointless.step_loop import StepLoop
from checkpointless.takeover import TakeOver

if TYPE_CHECKING:
    from torch.utils.data import DataLoader, IterableDataset

    from checkpointless.loaders.iterable_loader import IterableStepLoader
    from checkpointless.loaders.loader import StepLoader

log = logging.getLogger(__name__)

# FatalError and step_seed: their old import paths, kept
__all__ = ["Attempt", "FatalError", "Session", "step_seed"]


def _refusal(model: torch.nn.Module, device: torch.device, job: JobConfig) -> str | None:
    """Why a replicated ``model`` cannot train in ``job`` on ``device`` (None: it can)."""
    off = next(((n, t.device) for n, t in model.state_dict().items()
                if isinstance(t, torch.Tensor) and t.device != device), None)  # fmt: skip
    if off is not None:
        return (f"{off[0]!r} is on {off[1]} but this process trains on {device} (session.device): "
                "build the model on checkpointless.local_device()")  # fmt: skip
    if job.elastic or job.share_count != job.workers:
        synced = next((n for n, m in model.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)), None)
        if synced is not None:
            return (f"{repr(synced) if synced else 'the model'} is a SyncBatchNorm: its statistics depend on how many "
                    "replicas compute a step, which --shares, --min-workers and --max-workers change: use BatchNorm")  # fmt: skip
    return None


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
            (``module_state.BufferSync``). Turn it off only for buffers that stay equal
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
        self.seed, self.reseed_rng = seed, reseed_rng
        # where this process trains, from its slot on the host: known before a spare has a rank
        self.device: torch.device = local_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._steps = StepState()
        progress = Progress(self._steps)
        self._model: ModelHolder
        if model is not None:
            self._model = ReplicatedModel(model, optimizer, dict(state or {}), progress,
                                          overlap=overlap_reduction, broadcast_buffers=broadcast_buffers)  # fmt: skip
        else:
            assert build is not None
            self._model = ShardedModel(build, progress, broadcast_buffers=broadcast_buffers)
            # Every recovery drops a whole model, optimizer and mesh and collects them (cycles),
            # which scans every object of the process: keep what exists before the first
            # build (torch, transformers, the user's data) out of those scans.
            gc.freeze()
        alone = ENV_STORE not in os.environ  # no launcher: a job of this process alone
        spare = not alone and os.environ.get(ENV_ROLE, Role.WORKER) == Role.SPARE
        if alone:
            self._member = start_alone(self._model, self._steps, self.device, seed)
        else:
            die_with_parent()
            job = JobConfig.from_json(os.environ[ENV_CONFIG])
            self._member = member_of_the_job(job, self._model, self._steps, self.device, seed, spare=spare)
        self.job = self._member.job
        self._seeds = Seeds(seed, reseed_rng)
        self._shares = self._share_loop()
        self._takeover = TakeOver(self.job, self._member, self._model, self._steps)
        self._check = ReplicaCheck(self._member, self._model, self._steps)
        self._end = Ending(self._member, self._model, self._steps, self._check)
        self._record = StepCommit(self._member, self._model, self._steps)
        self._loop = StepLoop(self.job, self._member, self._model, self._steps, shares=self._shares, seeds=self._seeds,
                              takeover=self._takeover, check=self._check, end=self._end, record=self._record)  # fmt: skip
        if alone:
            return
        client = self._member.client
        assert client is not None
        if model is not None and (refused := _refusal(model, self.device, self.job)) is not None:
            self._member.fatal(refused)
        atexit.register(self._end.at_exit)
        joined = start_as_spare(self._member, self._model) if spare else start_as_worker(self._member)
        if not joined:  # the job ended while this spare waited
            self._end.spare_unused()
            raise SystemExit(0)
        Notice(client).install()  # a member now: SIGTERM hands its rank over

    # -- the parts' views, for the user ---------------------------------------------
    @property
    def model(self) -> torch.nn.Module | None:
        """The model being trained (sharded: this generation's; read it at each use)."""
        return self._model.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._model.optimizer

    @property
    def state(self) -> dict[str, Stateful]:
        """The more state registered with the model (sharded: what this generation's build returned)."""
        return self._model.state

    @property
    def rank(self) -> int:
        return self._member.rank

    @property
    def world_size(self) -> int:
        return self._member.world_size

    @property
    def generation(self) -> int:
        """The generation this process is a member of (0 until the first recovery)."""
        return self._member.generation

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded (``Session(build=...)``)."""
        return self._model.sharded

    @property
    def shard(self) -> int:
        """Which shard of the state this rank holds (0 when the state is replicated)."""
        return self._member.shard

    @property
    def replica(self) -> int:
        """Which copy of its shard this rank holds (the rank when the state is replicated)."""
        return self._member.replica

    @property
    def step(self) -> int:
        """The step the next attempt executes."""
        return self._steps.next

    @property
    def committed_step(self) -> int:
        """The last committed step (-1 before the first commit)."""
        return self._steps.committed

    @property
    def dp_rank(self) -> int:
        """Data-parallel rank: which slice of the global batch this rank reads (every rank reads
        its own, sharded or not: FSDP is data parallel too). Inside ``session.shares()``: the share
        being computed."""
        share = self._shares.current
        return self.rank if share is None else share

    @property
    def dp_size(self) -> int:
        """The number of slices of the global batch: the job's shares (``--shares``; by default one
        per worker), whatever the number of live replicas."""
        return self._shares.shares

    @property
    def held_shares(self) -> list[int]:
        """The shares this replica computes at the current step, in the order ``shares()`` yields
        them (under ``--never-wait`` a lost peer's may follow in the same attempt)."""
        return held_by(self.dp_size, self.rank, self.world_size, self.job.shards)

    def shares(self) -> Iterator[int]:
        """The shares this replica computes in the current step, each as ``dp_rank`` while its pass
        runs: ``for share in session.shares(): loss = model(loader.batch(step))...; loss.backward()``,
        then ``session.reduce_gradients()`` once. Before each share the RNG is reseeded from
        (seed, step, share) and the model's buffers set as the replica holding that share alone
        would hold them; only the last share's backward pass reduces, and the gradient is the sum
        over all the job's shares divided by their number (``checkpointless.share_loop``). With one
        share per replica (the default) it yields this rank and changes nothing."""
        if self._loop.current is None:
            self._member.fatal("session.shares() used outside `with session.attempt():`")
        # every rank reads its own part of the batch, sharded or not (``dp_rank``)
        return self._shares.run(self._steps.next, self.rank, self.world_size)

    def _share_loop(self) -> ShareLoop:
        return ShareLoop(self.job.share_count, shards=self.job.shards, hold=self._model.hold,
                         reseed=self._seeds.reseed, buffers=lambda: self._model.buffers, done=self._model.share_done,
                         end=lambda computed: self._takeover.end(computed))  # fmt: skip

    @property
    def process_group(self) -> Group | None:
        """The current generation's data-parallel process group, or None outside a launcher (a
        sharded model alone: a group of one). Replaced at every recovery: read it at each use."""
        return self._member.group

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
        yield from self._loop.steps(total, start)

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

    @contextlib.contextmanager
    def attempt(self) -> Iterator[Attempt]:
        """One try of the current step; commits on normal exit, recovers on any exception."""
        with self._loop.attempt() as current:
            yield current

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
        with self._loop.between() as block:
            yield block

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without reducing them (as
        ``DistributedDataParallel.no_sync()``): for gradient accumulation, one reduction per
        optimizer step, by the backward pass after the block. Bitwise the same with the overlapped
        reduction on and off. Sharded: FSDP2's ``set_requires_gradient_sync(False)``."""
        if self._loop.current is None:
            self._member.fatal("session.no_sync() used outside `with session.attempt():`")
        with self._model.no_sync():
            yield

    def reduce_gradients(self) -> None:
        """Average gradients across data-parallel ranks. Every rank calls it once per attempt,
        after ``backward()`` and before the optimizer update. Sharded, FSDP2 has reduced them
        already and this is one barrier over the ranks (every rank commits the step, or none).

        Raises ``CollectiveError`` if a peer failed; ``attempt`` handles it.
        """
        self._loop.reduce()

    def log(self, **metrics: Any) -> None:
        """Attach metrics (``loss``, ``tokens``, ...) to the current step's commit record.

        Only valid inside ``with session.attempt():``, so that a value is recorded
        for a step only if that step commits. Numbers, strings, NumPy scalars and
        one-element tensors are accepted. Inside ``session.shares()`` a number is kept per share
        and the commit records the mean over this replica's shares, with ``share_count``: the
        report's ``loss_by_step`` weighs each rank's ``loss`` by it.
        """
        if self._loop.current is None:
            self._member.fatal(
                "session.log() called outside `with session.attempt():` (after a failed attempt it "
                "would record the values of a step that did not commit); move it into the block"
            )
        try:
            values = {k: scalar(k, v) for k, v in metrics.items()}
        except TypeError as e:
            self._member.fatal(f"session.log(): {e}")
        self._record.log(values, self._shares.current)

    def emit(self, kind: str, **fields: Any) -> None:
        """Record a custom event (for example ``eval`` with ``heldout_loss``) at the committed step."""
        event: dict[str, Any] = {"rank": self.rank, "gen": self.generation, "step": self._steps.committed}
        try:
            event.update({k: scalar(k, v) for k, v in fields.items()})
        except TypeError as e:
            self._member.fatal(f"session.emit({kind!r}): {e}")
        if self._member.client is not None:
            self._member.client.emit(kind, **event)

    def state_digest(self) -> str:
        """SHA-256 of model, optimizer state and committed step (see ``digest_state``); sharded:
        of this rank's shard (equal on every replica of the shard)."""
        return self._model.digest(self._steps.committed)

    def finish(self) -> str:
        """Report the final state and stay available as a recovery source until the job ends.

        Every rank must call it after the loop. Returns the final state digest.
        """
        return self._end.finish()
