"""The member protocol: a failed step reported, the broken generation left, the next one's group
formed, its layout checked, state restored from the durable tier or moved peer to peer as the
coordinator's plan says (the holders comparing theirs first), and the step re-executed.

``Member`` is the only writer of the process's place in the job (rank, world size, generation),
of its group and, for a sharded model, of the generation's mesh, which the model holder receives;
the state it takes on the way in is its ``StateArrival``'s (``arrival.py``), moved as the plan
says by its ``GenerationEntry`` (``entry.py``); its ``AbortWatch`` (``aborts.py``) is what the
heartbeat thread saw of a generation's abort.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch

from checkpointless.aborts import AbortWatch
from checkpointless.arrival import StateArrival
from checkpointless.comm import CollectiveError, Group, is_collective_failure
from checkpointless.config import JobConfig
from checkpointless.consistency import TrainableAgreement
from checkpointless.control.client import ControlClient
from checkpointless.control.plan import Plan
from checkpointless.durable import DurableWriter
from checkpointless.entry import GenerationEntry
from checkpointless.errors import Dismissed, FatalError, IntegrityError, Unrecoverable
from checkpointless.fault_grammar import FaultSpec
from checkpointless.faults import FaultInjector
from checkpointless.following import CatchUps
from checkpointless.formation import Formation
from checkpointless.fsdp import Generation
from checkpointless.model_holder import ModelHolder
from checkpointless.progress import StepState
from checkpointless.protocol.vocab import Event, Phase, Reason
from checkpointless.replicas import own_lineage
from checkpointless.state import TransferStats

log = logging.getLogger(__name__)


def release_frames(exc: BaseException) -> None:
    """Drop the locals of a failure's finished frames (they may hold the broken group's ``Work``)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


class Member:
    """One process's place in the job's generations (see the module docstring). ``client`` is
    None for a process alone (no launcher): a generation of one, no recovery."""

    def __init__(
        self,
        job: JobConfig,
        model: ModelHolder,
        steps: StepState,
        *,
        device: torch.device,
        client: ControlClient | None = None,
        secret: bytes = b"",
        faults: FaultInjector | None = None,
        seed: int = 0,
        has_state: bool = True,
    ) -> None:
        self.job, self.device, self.client, self.faults = job, device, client, faults
        rc = job.recovery
        self.durable = (  # the optional durable tier (``durable.py``)
            DurableWriter.for_job(job, seed, on_event=self._durable_event)
            if client is not None and rc.durable_every and rc.durable_dir
            else None
        )
        self._model, self._steps, self._secret = model, steps, secret
        self.rank, self.world_size, self.generation = 0, 1, 0
        self.group: Group | None = None
        self._generation: Generation | None = None  # sharded: this generation's groups and mesh
        self.fatal_sent = False  # this process reported a mistake no recovery can fix
        self._host_ranks: list[int] = []  # the ranks on this process's host (a host fault hits them all)
        self.trainable = TrainableAgreement(self)
        self._arrival = StateArrival(model, steps, self.trainable, secret, has_state=has_state)
        self._aborts = None if client is None else AbortWatch(client)  # what the heartbeat thread saw
        #: the state's part of entering a generation (``entry.py``)
        self._entry = (
            None if client is None else GenerationEntry(self, client, model, steps, self._arrival, secret)
        )
        timeout = timedelta(seconds=rc.collective_timeout_s)
        #: the spares this process feeds in the background, or its own catch-up (``following``)
        self.catch_ups = None if client is None else CatchUps(client, secret, model, timeout)
        self._formation = (
            None
            if client is None
            else Formation(
                client,
                secret,
                backend=job.backend,
                device_type=device.type,
                sharded=model.sharded,
                timeout=timeout,
            )
        )

    def enter_alone(self) -> None:
        """No launcher: a generation of one (sharded: a 1 x 1 mesh; replicated: a default group of
        one, so that what a DDP script reads, ``dist.get_rank()`` or its own all-reduce, runs too)."""
        import torch.distributed as dist

        if self._model.sharded:
            self._generation = Generation(
                dist.HashStore(),
                gen=0,
                prefix="local/",
                rank=0,
                world=1,
                shards=1,
                device_type=self.device.type,
            )
            self.group = self._generation.group
            self._build()
        elif not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    # -- where it stands -----------------------------------------------------------
    @property
    def shard(self) -> int:
        """Which shard of the state this rank holds (0 when the state is replicated)."""
        return self.rank % self.job.shards

    @property
    def replica(self) -> int:
        """Which copy of its shard this rank holds (the rank when the state is replicated)."""
        return self.rank // self.job.shards

    @property
    def plan_timeout(self) -> timedelta:
        return timedelta(seconds=self.job.recovery.plan_timeout_s)

    @property
    def has_state(self) -> bool:
        """Whether this process holds valid job state (a spare does not until it receives)."""
        return self._arrival.has_state

    def _client(self) -> ControlClient:
        assert self.client is not None, "a process alone has no control plane"
        return self.client

    # -- what ends the job, what faults are injected --------------------------------
    def fatal(self, message: str) -> NoReturn:
        """End the job: report ``message`` (naming this rank) to the coordinator and raise ``FatalError``."""
        text = f"rank {self.rank}: {message}"
        if self.client is not None:
            log.error("[gen %d rank %d] %s", self.generation, self.rank, message)
            self.client.report_fatal(self.rank, text)
            self.fatal_sent = True  # the process's exit must not overwrite it
        raise FatalError(text)

    def fault_fired(self, index: int, fault: FaultSpec, rank: int, step: int) -> None:
        self._client().emit(
            Event.FAULT_INJECTED, sync=True, rank=rank, gen=self.generation, step=step, index=index,
            fault=fault.kind, ranks=list(fault.ranks) or (self._host_ranks if fault.node is not None else [rank]),
            target=fault.at, node=fault.node,
        )  # fmt: skip

    def _durable_event(self, kind: str, fields: dict[str, Any]) -> None:
        """A durable snapshot written, failed or skipped (from its writer thread): shipped at once."""
        if self.client is not None:
            self.client.emit(kind, sync=True, rank=self.rank, gen=self.generation, **fields)

    # -- waits that a peer's failure cuts short ---------------------------------------
    def wait_peer_json(self, key: str) -> Any:
        """A value a peer of this generation publishes, or ``CollectiveError`` as soon as the
        coordinator aborts the generation (a peer died): every wait inside a step becomes a
        normal recovery, never a wait for ``plan_timeout_s``."""
        seconds = self.plan_timeout.total_seconds()
        assert self._aborts is not None, "a process alone has no control plane"
        outcome = self._aborts.poll(self.generation, seconds, until=key)
        if outcome is None:
            raise TimeoutError(f"{key} was not published within {seconds:g} s")
        if outcome:
            raise CollectiveError(f"gen {self.generation}: aborted while waiting for {key}")
        return self._client().wait_json(key, self.plan_timeout)

    # -- failure and recovery -------------------------------------------------------
    def caused_by_peers(self, exc: Exception) -> bool:
        """Whether a failed step is a collective failure, by its cause, not its message: our own
        group operations raise ``CollectiveError``; an error raised inside a library's collective
        (FSDP2's all-gather: a bare ``RuntimeError`` naming gloo) counts only if the generation was
        aborted (a peer died or failed: the coordinator aborts it within its detection time).
        Anything else the step raised is the user's exception, re-executed a bounded number of times."""
        if isinstance(exc, CollectiveError):
            return True
        if not is_collective_failure(exc) or self._aborts is None:
            return False
        rc = self.job.recovery
        return self._aborts.poll(self.generation, rc.hang_timeout_s + 4 * rc.heartbeat_interval_s) is True

    def verify_join(self) -> None:
        """A spare that caught up and joined checks its state against its source's before any
        gradient of its first step leaves it (``StateArrival.verify``: ``IntegrityError`` if they
        differ)."""
        if self.client is not None:
            self._arrival.verify(self.client)

    def on_failure(self, exc: Exception, step: int, *, peers: bool | None = None, **fields: Any) -> None:
        """Report a failed attempt (or block: ``fields`` go into the event) and recover; ``peers``:
        whether peers caused it, when the caller already knows."""
        release_frames(exc)
        caused = self.caused_by_peers(exc) if peers is None else peers
        reason = Reason.COLLECTIVE_ERROR if caused else Reason.EXCEPTION
        if (
            reason == Reason.EXCEPTION
            and self._steps.failed_locally() > self.job.recovery.max_retries_per_step
        ):
            self.fatal(f"step {step} raised {self._steps.local_failures} times in a row: {exc!r}")
        self.detected(exc, step, reason, **fields)
        del exc
        self.recover(reason)

    def detected(self, exc: Exception, step: int, reason: str, **fields: Any) -> None:
        """A failed attempt (or block) said: the log line and the ``fault_detected`` event."""
        log.warning(
            "[gen %d rank %d step %d] step failed (%s): %s", self.generation, self.rank, step, reason, exc
        )
        self._client().emit(
            Event.FAULT_DETECTED, sync=True, rank=self.rank, gen=self.generation, step=step,
            reason=reason, error=str(exc)[:300], **fields,
        )  # fmt: skip

    def recover(self, reason: str, keep: Callable[[Plan, int], bool] | None = None) -> bool:
        """Leave the broken generation and enter the next one (loops if that one fails too).
        ``keep(plan, rank)``: whether the failed attempt goes on in ``plan``'s generation at ``rank``
        instead of being undone (``takeover``; the attempt was parked by the caller); whether it did."""
        client = self._client()
        client.watch_abort(None)
        kept = keep is not None
        with contextlib.suppress(IntegrityError):  # failed before its join's check: the verdict is reported
            self.verify_join()
        while True:
            self._leave(undo=not kept)
            client.update(phase=Phase.RECOVERING)
            client.report_failure(self.generation, self.rank, self._steps.committed, reason, self.has_state)
            if self._generation is not None:  # sharded: its cleanup overlaps the coordinator's planning
                self._generation.close()
                self._generation = None
            plan = client.wait_plan(self.generation + 1, self.plan_timeout)
            rank = plan.rank_of(client.proc)
            if rank is None and (client.proc in plan.dropped or client.proc in plan.replaced.values()):
                self._dismissed(plan)  # a smaller job, or a handoff: another process holds its rank
            if kept and (keep is None or rank is None or not keep(plan, rank)):
                self._model.undo_attempt()
                kept = False
            try:
                self.enter(plan)
                return kept
            except (CollectiveError, IntegrityError, TimeoutError) as e:
                release_frames(e)
                if kept:
                    self._model.undo_attempt()
                    kept = False
                reason = Reason.COLLECTIVE_ERROR
                log.warning("[gen %d rank %d] recovery failed: %s", plan.gen, self.rank, e)
                client.emit(
                    Event.FAULT_DETECTED, sync=True, rank=self.rank, gen=plan.gen,
                    step=self._steps.committed + 1, reason=reason, error=str(e)[:300],
                )  # fmt: skip

    def _dismissed(self, plan: Plan) -> NoReturn:
        """A smaller job let this process go (``checkpointless scale``), or a spare took its rank
        (a preemption notice): it leaves, exit status 0, without the rest of the script (its loop
        did not end)."""
        log.warning("[gen %d] the job goes on with %d replica(s) without this process: leaving",
                    plan.gen, plan.world_size)  # fmt: skip
        client = self._client()
        client.update(phase=Phase.DONE)
        client.flush()
        client.close()
        raise Dismissed(0)

    def join_failed(self, exc: Exception, gen: int, step: int) -> None:
        """A peer failed while this process joined its first generation: it stays and recovers
        like any survivor."""
        release_frames(exc)
        self._client().emit(Event.FAULT_DETECTED, sync=True, rank=self.rank, gen=gen, step=step,
                            reason=Reason.COLLECTIVE_ERROR, error=str(exc)[:300])  # fmt: skip
        self.recover(Reason.COLLECTIVE_ERROR)

    def _leave(self, undo: bool = True) -> None:
        """Undo the failed attempt (``undo``) and leave the generation: the peers released, the
        model's part of it dropped (sharded: this rank's state kept as plain tensors), the group
        aborted. The generation's own groups are closed after the failure is reported (``recover``)."""
        if undo:
            self._model.undo_attempt()
        if self.catch_ups is not None:
            self.catch_ups.drop()  # the failed attempt's optimizer records
        if self._generation is not None:
            self._generation.release()
        self._model.leave(keep=self.has_state)
        if self.group is not None:
            self.group.abort()  # the generation's own groups stay for close(); a control group goes
        self.group = None

    def _build(self) -> None:
        """Sharded: this generation's model built on its mesh."""
        assert self._generation is not None
        self._generation.use_caches()  # this thread's: the training thread
        try:
            self._model.enter(self._generation.mesh)
        except Unrecoverable as e:
            self.fatal(str(e))

    # -- entering a generation --------------------------------------------------------
    def enter(self, plan: Plan) -> None:
        """Join ``plan``'s generation: form its group, check layouts and move state as it says."""
        client = self._client()
        rank = plan.rank_of(client.proc)
        assert rank is not None, f"{client.proc} is not a member of generation {plan.gen}"
        self.rank, self.world_size, self.generation = rank, plan.world_size, plan.gen
        # what torchrun sets, once the rank is known (LOCAL_RANK comes from the launcher: the slot)
        here = plan.hosts.get(rank)
        on_host = sum(1 for h in plan.hosts.values() if h == here) if here else plan.world_size
        self._host_ranks = sorted(r for r, h in plan.hosts.items() if h == here) if here else [rank]
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(plan.world_size), LOCAL_WORLD_SIZE=str(on_host))
        client.update(rank=rank, gen=plan.gen, phase=Phase.JOINING)
        if self.catch_ups is not None and self.has_state:
            self.catch_ups.settle(plan, rank, self._steps.committed)
        self._arrival.exchanged({})
        if self.faults is not None and plan.newcomer(rank):
            self.faults.at_recovery(rank, plan.resume_step, self.fault_fired, at="join")
        if plan.shards > 1 and not self._model.sharded:
            self.fatal(
                f"the job has {plan.shards} shards per replica (--shards / parallel.shards) but "
                "Session(model) replicates the model: shard it with Session(build=...)"
            )
        if plan.gen == 0:
            self._steps.descend(own_lineage(0, rank))
        assert self._entry is not None and self._aborts is not None
        ahead = self._entry.hash_ahead(plan, rank)  # the holders' digests, while the group forms
        self._form(plan)
        assert self.group is not None
        # leave the generation as soon as the coordinator aborts it, even while its collectives
        # still work (a peer cut off from the coordinator only): the heartbeat thread releases it
        release = self._generation.release if self._generation is not None else self.group.release
        aborts = self._aborts
        client.watch_abort(plan.gen, lambda: aborts.aborted(plan.gen, release))
        if self._generation is not None:
            self._build()
        plan = self._entry.move(plan, rank, ahead, self._generation)  # layouts, rollback, transfers
        assert self._steps.committed == plan.resume_step - 1, (self._steps.committed, plan.resume_step)
        self._steps.resume(plan.resume_step, recovered=plan.gen > 0)
        client.update(phase=Phase.IDLE, committed=self._steps.committed)
        if self.catch_ups is not None and plan.followers:
            self.catch_ups.start(plan, rank, self._steps.committed)

    def check_abort(self) -> None:
        """A generation of one has no collective to fail: its member leaves an aborted one at the
        reduction."""
        if self.world_size == 1 and self._aborts is not None and self._aborts.seen == self.generation:
            raise CollectiveError(f"gen {self.generation}: aborted by the coordinator")

    def leave_if_planned(self) -> None:
        """As an attempt begins: leave a generation whose planned end this process saw."""
        if self._aborts is not None and self._aborts.planned == self.generation:
            self.recover(Reason.PLANNED)

    def _form(self, plan: Plan) -> None:
        assert self._formation is not None
        try:
            formed = self._formation.form(plan, self.rank)
        except Unrecoverable as e:
            self.fatal(str(e))
        if isinstance(formed, Generation):
            self._generation, self.group = formed, formed.group
        else:
            self.group = formed

    def resync_to(self, dst: int) -> None:
        """The consistency check: send this rank's state to a replica that differs from the majority."""
        assert self.group is not None
        self._arrival.resync_to(self.group, dst)

    def resync_from(self, ref: int, lineage: int, step: int) -> TransferStats:
        """The consistency check: this replica takes ``ref``'s state (``StateArrival.resync_from``)."""
        assert self.group is not None
        return self._arrival.resync_from(self.group, ref, lineage, step)
