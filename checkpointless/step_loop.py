"""``StepLoop``, held by the session: the machinery under ``session.steps()``, ``session.attempt()``,
``session.between_steps()`` and ``session.reduce_gradients()``. The loop checks the replicas when
due and sees a stop at each step boundary; an attempt begins (a planned change left first, the RNG
reseeded, the shares and the model readied, the heartbeat told), a failed one (or a block between
steps that a peer's failure cut short) is handed to the member's recovery, and one that reduced is
committed (``StepCommit``); the reduction fires the step's faults and checks the abort and a join
before the model reduces."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from checkpointless.comm import CollectiveError
from checkpointless.commit import StepCommit
from checkpointless.config import JobConfig
from checkpointless.consistency import ReplicaCheck
from checkpointless.ending import Ending
from checkpointless.errors import FatalError, IntegrityError, StepRecovered
from checkpointless.member import Member
from checkpointless.model_holder import ModelHolder
from checkpointless.progress import Attempt, Between, StepState
from checkpointless.protocol.vocab import Event, Phase
from checkpointless.seeds import Seeds
from checkpointless.share_loop import ShareLoop, assign
from checkpointless.takeover import TakeOver


class StepLoop:
    """The steps, their attempts and the reduction (see the module docstring); the only writer of
    the attempt under way."""

    def __init__(
        self,
        job: JobConfig,
        member: Member,
        model: ModelHolder,
        steps: StepState,
        *,
        shares: ShareLoop,
        seeds: Seeds,
        takeover: TakeOver,
        check: ReplicaCheck,
        end: Ending,
        record: StepCommit,
    ) -> None:
        self.job, self._member, self._model, self._steps = job, member, model, steps
        self._shares, self._seeds, self._takeover = shares, seeds, takeover
        self._check, self._end, self._record = check, end, record
        self.current: Attempt | None = None  # the attempt whose block is running
        self._reduced = False
        self._attempted = False

    def steps(self, total: int, start: int) -> Iterator[int]:
        """``session.steps(total, start=start)``'s loop (its docstring)."""
        first = self._steps.start_at(start)
        if self._member.client is not None:
            # the coordinator checks --fault steps against the total, and the ranks' starts
            self._member.client.update(
                total=total, **({"start": start, "committed": self._steps.committed} if first else {})
            )
        while True:
            if self._check.due():  # due before the last step too: checked, then the loop ends
                try:
                    self._check.run()
                except (CollectiveError, IntegrityError, TimeoutError) as e:
                    self._member.on_failure(e, self._steps.next)
                    continue
            if self._steps.next >= total:
                break
            self._end.leave_if_stopped()
            self._attempted = False
            yield self._steps.next
            if not self._attempted:
                message = "the body of `for step in session.steps(n)` must use `with session.attempt():`"
                if self._member.client is None:
                    raise RuntimeError(message)
                self._member.fatal(message)  # the same in every replacement: no spare can fix it
        self._steps.end_loop()

    def _outside_shares(self) -> int:
        """What an attempt's draws outside the share loop are seeded from, besides (seed, step): the
        rank, where every replica holds one share for the whole job (the share is the rank: the
        draws are the same as inside the loop); else S, no share's index: the same on every replica
        and at any size (a job whose replicas may hold several shares runs the loop)."""
        if self.job.elastic or self._shares.needed(self.job.workers):
            return self._shares.shares
        return self._member.rank

    @contextlib.contextmanager
    def attempt(self) -> Iterator[Attempt]:
        """``session.attempt()`` (its docstring)."""
        # a planned change (a resize, a handoff) seen during the last step starts at this boundary,
        # once the script's code after that step's block ran
        self._member.leave_if_planned()
        step = self._steps.next
        current = Attempt(step)
        self._attempted = True
        self.current, self._reduced = current, False
        self._record.begin()
        self._seeds.reseed(step, self._outside_shares())
        self._shares.begin_attempt()
        reexecuted = self._steps.begin_attempt()
        client = self._member.client
        if client is not None:
            client.update(phase=Phase.COMPUTE, step=step, attempt=self._steps.attempts)
            if reexecuted:
                client.emit(
                    Event.STEP_REEXECUTED, rank=self._member.rank, gen=self._member.generation, step=step
                )
        # the sum over the job's shares, whatever the live replicas (at one share each: the group's size)
        owners = (
            assign(self._shares.shares, self._member.world_size) if self.job.recovery.exact_resize else None
        )
        self._model.begin_attempt(
            self._member.group, step, self._member.trainable.agree, self._shares.shares, owners
        )
        t0 = time.perf_counter()
        try:
            yield current
        except FatalError:
            raise
        except StepRecovered:  # the member is in the next generation already (``takeover``)
            return
        except Exception as exc:
            if self._member.client is None:
                raise
            self.current = None
            self._member.on_failure(exc, step)
            return
        finally:
            self.current = None
        if self._member.client is not None and not self._reduced:
            self._member.fatal(
                f"step {step} ended without session.reduce_gradients(): every rank must reduce once "
                "per attempt, or its peers wait forever in the reduction"
            )
        self._record.commit(step, time.perf_counter() - t0)
        current.mark_committed()

    @contextlib.contextmanager
    def between(self) -> Iterator[Between]:
        """``session.between_steps()`` (its docstring)."""
        if self.current is not None:
            self._member.fatal("session.between_steps() used inside `with session.attempt():`")
        block = Between(self._steps.committed)
        try:
            yield block
        except FatalError:
            raise
        except Exception as exc:
            if self._member.client is None or not self._member.caused_by_peers(exc):
                raise
            self._member.on_failure(exc, self._steps.next, peers=True, between_steps=True)
            return
        block.mark_completed()

    def reduce(self) -> None:
        """``session.reduce_gradients()`` (its docstring)."""
        if self.current is None:
            self._member.fatal("session.reduce_gradients() called outside `with session.attempt():`")
        if self._shares.current is not None:
            self._member.fatal("session.reduce_gradients() called inside `for share in session.shares():`: "
                               "call it once, after the loop")  # fmt: skip
        if (self._shares.needed(self._member.world_size) or self.job.elastic) and not self._shares.used:
            fewer = (
                ", and another number after a resize (--min-workers, --max-workers)"
                if self.job.elastic
                else ""
            )
            self._member.fatal(
                f"the job's {self._shares.shares} shares (--shares) are computed by {self._member.world_size} replica(s){fewer}: "
                "each step must compute its replica's shares, `for share in session.shares():` around the forward "
                "and backward passes"
            )
        if self._member.faults is not None and not self._takeover.fired(self._steps.next):
            self._member.faults.at_step(
                self._member.rank, self._steps.next, self._member.fault_fired, corrupt=self._model.flip_bit
            )
        self._member.check_abort()
        self._member.verify_join()
        if self._member.client is not None:
            self._member.client.update(phase=Phase.REDUCE)
        self._model.reduce(self._member.group, self._steps.next, self._member.trainable.agree)
        self._reduced = True
