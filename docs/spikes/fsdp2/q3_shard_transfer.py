"""Q3: this rank's shard-only state (model + AdamW), sent point to point to a replacement at the same
shard position in the other replica, loaded into a *fresh* FSDP2 module/optimizer; bitwise checks.

argv[1]: how to load: dcp (set_model_state_dict/set_optimizer_state_dict, full_state_dict=False)
                      copy (p.to_local().copy_ + opt.state[p] = {...DTensor.from_local...})
"""
import sys
from hsdp import *

K, TOTAL = 3, 5  # transfer after K steps, train to TOTAL


def worker(rank, world, store, how, transfer):
    mesh = init_generation(store, 0, rank, world)
    model, opt = build(mesh)
    for s in range(K):
        train_step(model, opt, s, rank)
    report = {}
    if transfer:
        mine = local_state(model, opt)
        report["bytes"] = sum(t.numel() * t.element_size() for t in mine.values())
        report["keys"] = {k: tuple(v.shape) for k, v in mine.items()}
        # replicas (0,2) and (1,3) hold the same shard position: 0->2 and 1->3 over the default group
        if rank in (0, 1):
            send_state(mine, rank + 2)
        else:
            del model, opt  # the replacement throws its module away: fresh module on meta, fresh AdamW
            model, opt = build(mesh, seed=123, meta=True)
            template = local_state(model, opt)  # shapes only (this initialises empty AdamW state)
            got = recv_state(template, rank - 2)
            load_local_state(model, opt, got, how)
            after = local_state(model, opt)
            report["loaded == received (bitwise)"] = same(after, got)
            report["loaded == replacement's own pre-transfer state (bitwise)"] = same(after, mine)
    for s in range(K, TOTAL):
        train_step(model, opt, s, rank)
    final = local_state(model, opt)
    dist.destroy_process_group()
    return report, final


if __name__ == "__main__":
    how = sys.argv[1] if len(sys.argv) > 1 else "dcp"
    base = launch(worker, extra=(how, False))
    xfer = launch(worker, extra=(how, True))
    for r in range(4):
        if xfer[r][0] != "ok" or base[r][0] != "ok":
            print(r, xfer[r][1] if xfer[r][0] != "ok" else base[r][1]); continue
        print(f"rank {r}: {xfer[r][1][0]}")
        print(f"rank {r}: final shards after transfer+{TOTAL-K} steps == uninterrupted run (bitwise): "
              f"{same(xfer[r][1][1], base[r][1][1])}")
