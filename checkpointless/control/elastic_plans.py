"""The plans that change an elastic job's size (``recovery.min_workers`` / ``max_workers``): a
job that lost more ranks than it has ready spares goes on with fewer (``shrink_plan``), and a job
whose every member lives takes a new size (``resize_plan``). Sharded, by whole replicas. Each
renumbers or extends the members, then plans as ``plan.make_plan`` does after a failure.
"""

from __future__ import annotations

from dataclasses import replace

from checkpointless.control.plan import Plan, make_plan
from checkpointless.errors import PlanError


def shrink_plan(
    prev: Plan,
    committed: dict[int, int],
    spares: list[str],
    holders: set[int] | None = None,
    *,
    min_size: int,
    durable_on: bool = False,
    durable_step: int | None = None,
    hosts: dict[str, str] | None = None,
) -> Plan:
    """The next generation of an elastic job that lost more ranks than it has ready spares: whole
    replicas leave the job (``dropped``: a sharded replica's live ranks too), as few as leave the
    spares enough to take the other lost ranks (``replicas_to_drop``), and the members are
    numbered anew in their old order, each keeping its shard (the survivors' shares are reassigned
    by rank: ``share_loop.assign``). Then as ``make_plan``. Fewer than ``min_size`` ranks left:
    ``PlanError``."""
    dead = sorted(set(prev.members) - set(committed))
    drop = replicas_to_drop(dead, len(spares), prev.shards)
    size = prev.world_size - len(drop)
    if size < min_size:
        raise PlanError(
            f"{len(dead)} rank(s) lost and {len(spares)} spare(s) ready: {size} rank(s) would be left, "
            f"fewer than --min-workers {min_size}"
        )
    keep = [r for r in sorted(prev.members) if r not in drop]
    new = {old: i for i, old in enumerate(keep)}  # whole replicas go: each keeps its shard index
    smaller = Plan(
        gen=prev.gen, world_size=size, shards=prev.shards, members={new[r]: prev.members[r] for r in keep},
        resume_step=prev.resume_step, hosts={new[r]: h for r, h in prev.hosts.items() if r in new},
    )  # fmt: skip
    plan = make_plan(
        smaller, {new[r]: c for r, c in committed.items() if r in new}, spares,
        None if holders is None else {new[r] for r in holders if r in new},
        durable_on=durable_on, durable_step=durable_step, hosts=hosts,
    )  # fmt: skip
    return replace(plan, dropped=[prev.members[r] for r in drop])


def replicas_to_drop(dead: list[int], spares: int, shards: int) -> list[int]:
    """The ranks of the fewest replicas whose leaving lets ``spares`` take every other lost rank:
    those with the most lost ranks first, the highest first among equals (one rank per replica:
    the highest lost ranks, the lowest taking the spares)."""
    lost: dict[int, int] = {}
    for r in dead:
        lost[r // shards] = lost.get(r // shards, 0) + 1
    left, drop = len(dead), []
    for replica in sorted(lost, key=lambda q: (-lost[q], -q)):
        if left <= spares:
            break
        drop.append(replica)
        left -= lost[replica]
    return sorted(r for q in drop for r in range(q * shards, (q + 1) * shards))


def resize_plan(
    prev: Plan,
    committed: dict[int, int],
    size: int,
    spares: list[str],
    *,
    hosts: dict[str, str] | None = None,
) -> Plan:
    """The next generation of an elastic job whose every member lives (all in ``committed``), with
    ``size`` replicas: a larger job gives its new ranks (numbered after the others) to ``spares``,
    which receive the state like replacements; a smaller one lets its highest ranks go
    (``dropped``); sharded, by whole replicas. Then as ``make_plan``. Fewer spares than new ranks,
    or a size that is not whole replicas: ``PlanError``."""
    if size % prev.shards:
        raise PlanError(f"{size} ranks are not whole replicas of {prev.shards} shards")
    lost = sorted(set(prev.members) - set(committed))
    if lost:
        raise PlanError(f"ranks {lost} are lost: a change of size needs every member")
    if size < prev.world_size:
        keep = {r: prev.members[r] for r in range(size)}
        smaller = Plan(
            gen=prev.gen, world_size=size, shards=prev.shards, members=keep, resume_step=prev.resume_step,
            hosts={r: h for r, h in prev.hosts.items() if r < size},
        )  # fmt: skip
        plan = make_plan(smaller, {r: c for r, c in committed.items() if r < size}, [], hosts=hosts)
        return replace(plan, dropped=[prev.members[r] for r in range(size, prev.world_size)])
    new = list(range(prev.world_size, size))
    if len(spares) < len(new):
        raise PlanError(f"{len(new)} new rank(s) but only {len(spares)} spare(s) ready")
    # the new ranks are planned as lost ranks of a job of ``size`` (the spares take them and receive
    # the state from the holders, spread as for replacements); no process held them
    placeholder = {r: f"<new rank {r}>" for r in new}
    larger = Plan(
        gen=prev.gen, world_size=size, shards=prev.shards, members={**prev.members, **placeholder},
        resume_step=prev.resume_step, hosts=prev.hosts,
    )  # fmt: skip
    plan = make_plan(larger, committed, spares, hosts=hosts)
    return replace(plan, replaced={r: p for r, p in plan.replaced.items() if r not in placeholder}, grown=new)
