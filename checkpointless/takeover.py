"""A survivor's step that goes on when a peer is lost at its end (``recovery.never_wait``).

Under never-wait the shares of a lost replica go to the survivors at once (``control/course.py``).
A survivor that undid its failed attempt would compute the step again at the new size, its own
shares' forward and backward passes (done already: most of a step) among them. Here it keeps them:

1. The gradient buckets reduce only at the reduction, not during the backward passes: every
   gradient stays local until then (``ReplicatedModel.no_overlap``).
2. At the end of the share loop (after the replica's last share, before ``reduce_gradients``) the
   replicas check that each of them got there: one all-reduce of one element on the control
   group. A peer lost before (killed, hung, cut off, or failed with an error of its own) fails the
   check on the survivors, with no gradient touched.
3. The survivor reports the failure as any member does, its attempt parked (the buffers its passes
   moved set aside, the committed ones in place: what a catch-up copies). If the plan keeps its
   rank at the same step, with nothing to receive, and its new shares begin with those it
   computed (contiguous blocks: the highest replica lost, or any loss at two replicas; a peer that
   raised and stays), it enters the new generation and the loop yields the shares it lacks in the
   same attempt: the script's code runs them as for any replica that holds several. The gradients
   add up in the order a fresh attempt's would (with ``--exact-resize`` each share's is kept apart
   and the sum is over the new owners): the step's bits are those of the step executed again.
4. Any other plan, or a failure while entering it: the attempt is undone and the step executed
   again (``StepRecovered`` ends the attempt's block).

A peer lost after the check (during the reduction) is recovered as before. The fault injector's
step faults fire just before the check, where a step's passes are done ("before the gradient
reduction"). The steady cost: the check's round trip, and a reduction that no longer overlaps the
backward pass (``bench/never_wait.py``).
"""

from __future__ import annotations

import torch

from checkpointless.config import JobConfig
from checkpointless.control.plan import Plan
from checkpointless.errors import StepRecovered
from checkpointless.member import Member, release_frames
from checkpointless.model_holder import ModelHolder, ReplicatedModel
from checkpointless.progress import StepState
from checkpointless.protocol.vocab import Event, Phase, Reason
from checkpointless.share_loop import assign


class TakeOver:
    """The end of a replica's shares under never-wait (see the module docstring): ``end`` is the
    share loop's; ``fired(step)`` whether the step's faults fired there already."""

    def __init__(self, job: JobConfig, member: Member, model: ModelHolder, steps: StepState) -> None:
        self._job, self._member, self._steps = job, member, steps
        self._model = model if isinstance(model, ReplicatedModel) else None
        self.on = (
            self._model is not None and member.client is not None and job.recovery.never_wait
            and job.shards == 1
        )  # fmt: skip
        self._fired = -1  # the last step whose faults fired at the loop's end
        if self.on:
            assert self._model is not None
            self._model.no_overlap()

    def fired(self, step: int) -> bool:
        return self._fired == step

    def end(self, computed: list[int]) -> list[int]:
        """After the replica's last share: the step's faults, then the check; the shares to compute
        next in this attempt (none unless a peer was lost and this replica took its shares)."""
        if not self.on:
            return []
        member, step = self._member, self._steps.next
        if self._fired != step and member.faults is not None:
            assert self._model is not None
            member.faults.at_step(member.rank, step, member.fault_fired, corrupt=self._model.flip_bit)
        self._fired = step
        member.verify_join()  # a spare that just joined: before the check, which its peers make too
        while True:
            group = member.group
            if group is None or group.world_size == 1:
                return []
            try:
                group.control.allreduce_([torch.zeros(1)])
                return []
            except Exception as exc:
                if not member.caused_by_peers(exc):
                    raise
                extra = self._carry(exc, step, computed)
            if extra:
                return extra
            # nothing to add: the check again, in the new generation, where every member makes it
            # at the end of its shares (those that execute the step again too)

    def _carry(self, exc: Exception, step: int, computed: list[int]) -> list[int]:
        """The check failed: the failure reported and the next generation entered with the attempt
        kept when its plan allows (the module docstring); the shares this replica adds."""
        member, model = self._member, self._model
        assert model is not None and member.client is not None
        release_frames(exc)
        member.detected(exc, step, Reason.COLLECTIVE_ERROR)
        del exc
        parked = model.park_attempt()
        carriable = model.carriable()
        shares = self._job.share_count

        def keep(plan: Plan, rank: int) -> bool:
            if not carriable or plan.resume_step != step or rank in plan.sources or plan.restore is not None:
                return False
            return list(assign(shares, plan.world_size)[rank])[: len(computed)] == computed

        if not member.recover(Reason.COLLECTIVE_ERROR, keep):
            raise StepRecovered(f"step {step} runs again in generation {member.generation}")
        owners = assign(shares, member.world_size)
        model.resume_attempt(parked, member.group, owners)
        self._steps.continued()
        extra = list(owners[member.rank])[len(computed) :]
        member.client.update(phase=Phase.COMPUTE, step=step)
        member.client.emit(Event.SHARES_TAKEN_OVER, rank=member.rank, gen=member.generation, step=step,
                           shares=extra)  # fmt: skip
        if extra and member.faults is not None:
            member.faults.at_recovery(member.rank, step, member.fault_fired, at="takeover")
        return extra
