"""The exact sum over shares (``--exact-resize``): a step's gradient summed in share order, so that
its bits do not depend on how many replicas computed it, nor on which shares each held.

An all-reduce sums in an order of its own that depends on the number of members (gloo's ring and
reduce-scatter alike), so a job that changes size changes the rounding of its gradient. Here every
replica keeps each of its shares' gradients apart (``GradientReducer.stash``), and per bucket:

1. the bucket is cut into N chunks, one per live replica, sizes differing by at most one;
2. an all-to-all sends every share's chunk j to replica j (a replica holding k shares sends k);
3. replica j sums the S chunks it received in share order, ``((g_0 + g_1) + g_2) + ...``: the
   senders are in rank order and hold contiguous blocks of shares (``share_loop.assign``);
4. an all-gather puts the N summed chunks together on every replica.

Each element is the same sum in the same order at any size: the result is bit for bit the same
whether 1, 2 or S replicas computed the step. Memory: a replica keeps one gradient per share it
holds (k copies), and the all-to-all's buffers hold about two more. Cost: the same bytes on the
wire as a ring all-reduce (a reduce-scatter and an all-gather), without overlap with the backward
pass.
"""

from __future__ import annotations

import torch

from checkpointless.comm import Group


def chunk_sizes(n: int, parts: int) -> list[int]:
    """``n`` elements cut into ``parts`` contiguous chunks whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def share_sum(group: Group | None, owners: list[range], stashed: dict[int, list[torch.Tensor]],
              out: list[torch.Tensor]) -> None:  # fmt: skip
    """``out[b]`` = the sum over every share, in share order, of its bucket ``b``. ``owners``: the
    shares of each replica (``share_loop.assign``); ``stashed``: this replica's shares' buckets."""
    if group is None or group.world_size == 1:
        order = sorted(stashed)
        for b, o in enumerate(out):
            o.copy_(stashed[order[0]][b])
            for s in order[1:]:
                o.add_(stashed[s][b])
        return
    n_ranks, me = group.world_size, group.rank
    mine = owners[me]
    shares = sum(len(r) for r in owners)
    for b, o in enumerate(out):
        sizes = chunk_sizes(o.numel(), n_ranks)
        starts = [sum(sizes[:j]) for j in range(n_ranks)]
        send = torch.cat(
            [stashed[s][b][starts[j] : starts[j] + sizes[j]] for j in range(n_ranks) for s in mine]
        )
        recv = torch.empty(shares * sizes[me], dtype=o.dtype, device=o.device)
        group.alltoall(recv, send, [len(owners[i]) * sizes[me] for i in range(n_ranks)],
                       [len(mine) * sizes[j] for j in range(n_ranks)])  # fmt: skip
        parts = recv.view(shares, sizes[me])
        mine_sum = torch.zeros(max(sizes), dtype=o.dtype, device=o.device)
        acc = mine_sum[: sizes[me]]
        acc.copy_(parts[0])
        for s in range(1, shares):
            acc.add_(parts[s])
        gathered = group.allgather(mine_sum)
        o.copy_(torch.cat([gathered[j][: sizes[j]] for j in range(n_ranks)]))
