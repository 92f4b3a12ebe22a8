"""Q4: determinism of HSDP (FSDP2, gloo, CPU), 4 processes.

(a) two independent runs of the same 8-step training: final local shards (params + AdamW state) and
    losses bitwise equal?
(b) re-executed step: at step 4, snapshot local_state; run the step; restore the snapshot (load_local_state
    into the SAME module/optimizer, argv[1] = dcp|copy); zero grads; run the step again -> bitwise equal
    to the first execution? Also a step abandoned after backward (grads reduced, no optimizer.step) and
    redone. Finals are compared with run (a).
"""
import sys
from hsdp import *

STEPS, K = 8, 4


def worker(rank, world, store, how, reexec):
    mesh = init_generation(store, 0, rank, world)
    model, opt = build(mesh)
    losses, rep = [], {}
    for s in range(STEPS):
        if reexec and s == K:
            snap = local_state(model, opt)
            l1 = train_step(model, opt, s, rank)
            first = local_state(model, opt)
            load_local_state(model, opt, snap, how)
            rep["restore == snapshot (bitwise)"] = same(local_state(model, opt), snap)
            opt.zero_grad(set_to_none=True)
            l2 = train_step(model, opt, s, rank)
            rep["re-executed step == first execution (bitwise)"] = same(local_state(model, opt), first) and l1 == l2
            losses.append(l2)
            continue
        if reexec and s == K + 1:  # abandoned attempt: forward + backward (grads reduced), no optimizer step
            x, y = batch(s, rank)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.zero_grad(set_to_none=True)
        losses.append(train_step(model, opt, s, rank))
    out = local_state(model, opt)
    end_generation()
    return rep, out, losses


if __name__ == "__main__":
    how = sys.argv[1] if len(sys.argv) > 1 else "dcp"
    a1 = launch(worker, extra=(how, False))
    a2 = launch(worker, extra=(how, False))
    b = launch(worker, extra=(how, True))
    for r in range(4):
        if any(x[r][0] != "ok" for x in (a1, a2, b)):
            print(r, [x[r][1] for x in (a1, a2, b) if x[r][0] != "ok"][0]); continue
        print(f"rank {r}: run1 == run2: shards {same(a1[r][1][1], a2[r][1][1])}, losses {a1[r][1][2] == a2[r][1][2]}"
              f" | {b[r][1][0]} | final with re-executions == run1: {same(b[r][1][1], a1[r][1][1])},"
              f" losses {b[r][1][2] == a1[r][1][2]}")
