"""The member protocol: a failed step reported, the broken generation left, the next one's group
formed, its layout checked, state restored from the durable tier or moved peer to peer as the
coordinator's plan says (the holders comparing theirs first), and the step re-executed."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import traceback
from datetime import timedelta
from typing import Any

import torch

from checkpointless.comm import CollectiveError, Group, is_collective_failure
from checkpointless.consistency import ReplicaConsistency
from checkpointless.control.auth import pg_token
from checkpointless.control.client import (
    connect,
)
from checkpointless.control.plan import Plan, ReplicaMap
from checkpointless.durable import load as load_durable
from checkpointless.errors import IntegrityError
from checkpointless.fsdp import Generation
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event, Phase, Reason
from checkpointless.replicas import choose_sources, own_lineage
from checkpointless.sockets import release_formation, sockets
from checkpointless.state import (
    combined_digest,
    frozen,
    recv_state,
    send_state,
)

log = logging.getLogger(__name__)


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


def _drop_formed(result: dict[str, Any]) -> None:
    """Tear down what an abandoned formation built (its groups hold the process's default group)."""
    if "generation" in result:
        result["generation"].close()
    if "group" in result:
        result["group"].abort()


def _holders_can_disagree(plan: Plan) -> bool:
    """Whether some replica group that receives state in ``plan`` keeps two holders or more (the
    members that keep their state, not receiving): only then can their comparison change a source.
    With one holder (two replicas, or HSDP with two per shard) it is the source whatever its digest,
    and the hashing it would cost is skipped."""
    layout = ReplicaMap(plan.world_size, plan.shards)
    for shard in range(plan.shards):
        group = layout.replica_group(shard)
        if any(r in plan.sources for r in group) and sum(r not in plan.sources for r in group) > 1:
            return True
    return False


class Member(ReplicaConsistency):
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

    def _on_failure(self, exc: Exception, step: int, *, peers: bool | None = None, **fields: Any) -> None:
        """Report a failed attempt (or block: ``fields`` go into the event) and recover; ``peers``:
        whether peers caused it, when the caller already knows."""
        _release_frames(exc)
        caused = self._caused_by_peers(exc) if peers is None else peers
        reason = Reason.COLLECTIVE_ERROR if caused else Reason.EXCEPTION
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
            reason=reason, error=str(exc)[:300], **fields,
        )  # fmt: skip
        del exc
        self._recover(reason)

    def _recover(self, reason: str) -> None:
        """Leave the broken generation and enter the next one (loops if that one fails too)."""
        assert self._client is not None
        self._client.watch_abort(None)
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
            # a formation abandoned by an abort: the default group is global, so it must
            # end (it fails at the latest at the collective timeout) before the next one starts
            stale, stale_result = self._forming
            stale.join(timeout.total_seconds() + 5)
            if stale.is_alive():
                self._fatal(f"a group formation abandoned before generation {plan.gen} did not end")
            _drop_formed(stale_result)
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
                        backend=self.job.backend, timeout=timeout, default=True,
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
                # wait fails now, and the formation, which holds the process's one default
                # group, ends before the next one starts (a fresh spare in the next generation
                # would otherwise wait for this rank in vain, and time out in turn)
                release_formation(before, client.addr)
                t.join(timeout=5.0)
                if t.is_alive():
                    self._forming = (t, result)
                else:  # ended, or formed just as the abort came
                    _drop_formed(result)
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
        # what torchrun sets, once the rank is known (LOCAL_RANK comes from the launcher: the slot)
        here = plan.hosts.get(rank)
        on_host = sum(1 for h in plan.hosts.values() if h == here) if here else plan.world_size
        self._host_ranks = sorted(r for r, h in plan.hosts.items() if h == here) if here else [rank]
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(plan.world_size), LOCAL_WORLD_SIZE=str(on_host))
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
            and self.job.recovery.consistency_every > 0 and _holders_can_disagree(plan)
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
        # leave the generation as soon as the coordinator aborts it, even while its collectives
        # still work (a peer cut off from the coordinator only): the heartbeat thread releases it
        release = (
            self._generation_state.release if self._generation_state is not None else self._group.release
        )
        client.watch_abort(plan.gen, release)
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
            # the frozen parameters it holds alike stay (a LoRA base): state/frozen.py
            offered = frozen.offer(mine, self.model)
            frozen.send_offer(self._group, src, offered)
            received, stats = recv_state(
                self._group, src, between=hook, key=self._secret, into={"state": mine}
            )
            state, kept = frozen.fill_in(received, mine, offered)
            del mine, received
            self._registry.load_state_dict(state)
            self._buffers.commit()
            self._has_state = True
            # the source's lineage: as the holders exchanged it, else as its state says
            sent = state.get("progress", {}).get("lineage")
            self._lineage = self._lineages.get(src, own_lineage(plan.gen, src) if sent is None else int(sent))
            client.emit(
                Event.TRANSFER_ENDED, rank=rank, gen=plan.gen, step=plan.resume_step, src=src,
                bytes=stats.bytes, seconds=stats.seconds, waited_s=round(stats.waited_s, 4), sha256_ok=True,
                kept_bytes=kept,
            )  # fmt: skip
        for dst in sorted(r for r, s in sources.items() if s == rank):
            if self._faults is not None:
                self._faults.at_recovery(rank, plan.resume_step, self._fault_fired, at="source")
            offered = frozen.recv_offer(self._group, dst)
            sent, kept = frozen.leave_out(self._registry.state_dict(), self.model, offered)
            stats = send_state(self._group, dst, sent, key=self._secret)
            del sent
            log.info(
                "[gen %d rank %d] sent %d bytes to rank %d in %.3fs (%d bytes of frozen parameters it held alike "
                "not sent)", plan.gen, rank, stats.bytes, dst, stats.seconds, kept,
            )  # fmt: skip
        if self._reducer is not None and self._reducer.stale():  # the flags came with the state
            self._rebuild_reducer(plan.resume_step, agreed=True)
        if plan.world_size > 1 and self._committed < 0 and plan.restore is None:
            # nothing committed yet (generation 0, or a recovery before the first commit): every
            # replica starts from rank 0's parameters and buffers, as DDP's do
            self._start_from_replica_0()
        assert self._committed == plan.resume_step - 1, (self._committed, plan.resume_step)
        self._next_step = plan.resume_step
        self._reexecute = plan.resume_step if plan.gen > 0 else None
        client.update(phase=Phase.IDLE, committed=self._committed)
