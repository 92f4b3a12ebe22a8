"""Q2: rebuild the mesh for a new generation inside the same processes.

argv[1]:
  stale    : destroy_process_group + init_process_group(new prefix) + new mesh, keep the OLD FSDP module
             (it keeps training, silently on the OLD generation's gloo groups: destroy does not close them)
  refully  : same, then fully_shard(old_module, mesh=new_mesh) again
  fromgroup: same, but the new mesh from DeviceMesh.from_group([rep_pg, shard_pg]) of dist.new_group groups
  rebuild  : 5 processes. gen 0 = procs 0-3; proc 3 dies (os._exit) at the start of step 3; survivors catch
             the error, reshard, keep their local shards, destroy everything, join gen 1 with the hot spare
             (proc 4 -> rank 3), which receives rank 1's shard; all re-execute step 3 and train to step 6.
             Final shards are compared bitwise with an uninterrupted 6-step run.
"""
import sys, time
from hsdp import *
from torch.distributed.fsdp import FSDPModule

FAIL_STEP, TOTAL = 3, 6


def simple(rank, world, store, mode):
    mesh = init_generation(store, 0, rank, world)
    model, opt = build(mesh)
    for s in range(2):
        train_step(model, opt, s, rank)
    mesh1 = init_generation(store, 1, rank, world)  # destroy_process_group + clear DTensor caches + gc, new groups
    res = {}
    if mode == "fromgroup":
        from torch.distributed.device_mesh import DeviceMesh
        mine = [g for g in ([0, 2], [1, 3]) if rank in g][0], [g for g in ([0, 1], [2, 3]) if rank in g][0]
        groups = {}
        for ranks in ([0, 2], [1, 3], [0, 1], [2, 3]):  # new_group must be called by every rank, same order
            pg = dist.new_group(ranks)
            if rank in ranks:
                groups[tuple(ranks)] = pg
        mesh1 = DeviceMesh.from_group([groups[tuple(mine[0])], groups[tuple(mine[1])]], "cpu",
                                      mesh=[[0, 1], [2, 3]], mesh_dim_names=NAMES)
        res["mesh"] = str(mesh1)
        state = local_state(model, opt)
        model, opt = build(mesh1, meta=True)
        local_state(model, opt)
        load_local_state(model, opt, state)
    try:
        if mode == "refully":
            fully_shard(model, mesh=mesh1)
            res["refully_shard"] = "returned"
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        res["loss"] = train_step(model, opt, 2, rank)
        res["params"] = [str(p.device_mesh) for p in model.parameters()][:1]
        mi = model[0]._get_fsdp_state()._fsdp_param_group.mesh_info
        res["module's shard pg is the new mesh's"] = mi.shard_process_group is mesh1.get_group("shard")
        res["module's shard pg name / new"] = (mi.shard_process_group.group_name, mesh1.get_group("shard").group_name)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    dist.destroy_process_group()
    return res


def reshard_all(model):
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


T0 = time.time()


def say(proc, msg):
    print(f"[{time.time() - T0:6.2f}s proc {proc}] {msg}", file=sys.stderr, flush=True)


def rebuild(rank, world, store, mode, fail=True):
    proc = rank  # process id; gen-0 rank == proc for 0..3, proc 4 is the spare
    log = {}
    model = opt = None
    if proc < 4:
        mesh = init_generation(store, 0, proc, 4, timeout=timedelta(seconds=20))
        model, opt = build(mesh)
        step = 0
        try:
            for step in range(TOTAL if not fail else FAIL_STEP + 1):
                if fail and proc == 3 and step == FAIL_STEP:
                    os._exit(1)  # a dead peer
                say(proc, f"step {step}") if fail else None
                train_step(model, opt, step, proc)
            if not fail:
                out = local_state(model, opt)
                dist.destroy_process_group()
                return log, out
        except Exception as e:
            say(proc, f"gen0 step {step} error {type(e).__name__}: {str(e)[:150]}")
            log["gen0 error"] = f"step {step}: {type(e).__name__}: {str(e)[:160]}"
            del e
        # survivor: nothing committed for this step; drop the partial step and keep the local shard
        t = time.time()
        reshard_all(model)
        say(proc, "resharded")
        opt.zero_grad(set_to_none=True)
        log["all params are DTensor after reshard"] = all(isinstance(p, DTensor) for p in model.parameters())
        mine = local_state(model, opt)
        if mode == "rebuild":  # drop every reference to gen-0 groups so that their sockets close
            del model, opt, mesh
            end_generation()
            say(proc, "dropped gen0 module/optimizer/mesh, destroyed groups, cleared DTensor caches")
    # ---- generation 1: procs 0,1,2 keep their ranks, the spare (proc 4) takes rank 3
    rank1 = {0: 0, 1: 1, 2: 2, 4: 3}[proc]
    t = time.time()
    mesh = init_generation(store, 1, rank1, 4)  # destroy_process_group() on survivors, then fresh groups
    log["gen1 join s"] = round(time.time() - t, 2)
    say(proc, "joined gen1")
    model, opt = build(mesh, seed=99, meta=True)
    template = local_state(model, opt)
    if rank1 == 3:
        mine = recv_state(template, 1)  # its replica peer at the same shard position
    elif rank1 == 1:
        send_state(mine, 3)
    load_local_state(model, opt, mine)
    for step in range(FAIL_STEP, TOTAL):  # step FAIL_STEP is re-executed
        log[f"loss{step}"] = train_step(model, opt, step, rank1)
    out = local_state(model, opt)
    dist.destroy_process_group()
    return log, out


def baseline(rank, world, store):
    return rebuild(rank, world, store, "rebuild", fail=False)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "rebuild"
    if mode != "rebuild":
        out = launch(simple, extra=(mode,))
        for r in sorted(out):
            print(r, out[r][1])
        sys.exit()
    t = time.time()
    out = launch(rebuild, world=5, extra=(mode,), timeout=120)
    print(f"wall {time.time() - t:.1f}s")
    base = launch(baseline, world=4)
    for proc in (0, 1, 2, 4):
        st, res = out.get(proc, ("missing", None))
        if st != "ok":
            print(proc, st, res); continue
        r1 = {0: 0, 1: 1, 2: 2, 4: 3}[proc]
        print(f"proc {proc} (gen1 rank {r1}): {res[0]}")
        print(f"   final shards == uninterrupted run (bitwise): {same(res[1], base[r1][1][1])}")
    print("proc 3:", out.get(3, ("no result (died)",))[0])
