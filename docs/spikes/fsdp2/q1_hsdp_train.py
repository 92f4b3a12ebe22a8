"""Q1: FSDP2 fully_shard on a 2x2 (replicate, shard) DeviceMesh, gloo on CPU, 4 processes.

Variants (argv[1]):
  initpg     : dist.init_process_group(store=PrefixStore) + init_device_mesh("cpu", (2,2))
  fromgroup  : NO init_process_group; raw ProcessGroupGloo per mesh dim + DeviceMesh.from_group
  initpg_raw : init_process_group, then DeviceMesh.from_group with the raw ProcessGroupGloo objects (as comm.py builds)
  initpg_wrapped: init_process_group, raw ProcessGroupGloo wrapped in a registered ProcessGroup (private APIs) + from_group
  manual     : NO init_process_group; raw ProcessGroupGloo per mesh dim + DeviceMesh(..., _rank=, _init_backend=False)
               + registration of the groups (private APIs)
"""
import sys
from common import *
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

MESH = [[0, 1], [2, 3]]  # dim0 = replicate, dim1 = shard
NAMES = ("replicate", "shard")
STEPS = 5


def raw_dim_groups(store, rank, prefix, timeout=TIMEOUT):
    """One ProcessGroupGloo per mesh dim, each on its own PrefixStore, with the sub-group's local rank."""
    t = torch.tensor(MESH)
    r, s = [(i, j) for i in range(2) for j in range(2) if MESH[i][j] == rank][0]
    rep_ranks = t[:, s].tolist()  # same shard position, other replicas
    shard_ranks = t[r, :].tolist()  # my replica
    rep = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/rep/{s}/", store), rep_ranks.index(rank), len(rep_ranks), timeout)
    sh = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/shard/{r}/", store), shard_ranks.index(rank), len(shard_ranks), timeout)
    return rep, sh, rep_ranks, shard_ranks


def wrap_and_register(backend, store_prefix_store, name, ranks, rank):
    """Wrap a raw ProcessGroupGloo (a c10d *Backend*) in a ProcessGroup and register it with c10d
    the way new_group does (private APIs), without any default group."""
    from torch.distributed import distributed_c10d as c10d
    pg = dist.ProcessGroup(store_prefix_store, ranks.index(rank), len(ranks))
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    pg._set_group_name(name)
    c10d._register_pg_in_world(pg, backend_name="gloo", store=store_prefix_store, group_name=name,
                               backend_config="cpu:gloo", rank_mapping={g: i for i, g in enumerate(ranks)})
    return pg


def build_mesh(variant, rank, world, store, gen=0):
    prefix = f"gen{gen}"
    if variant == "initpg":
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix + "/world/", store), rank=rank,
                                world_size=world, timeout=TIMEOUT)
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=NAMES)
    if variant.startswith("initpg_"):
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix + "/world/", store), rank=rank,
                                world_size=world, timeout=TIMEOUT)
    rep, sh, rr, sr = raw_dim_groups(store, rank, prefix)
    if variant == "initpg_raw":
        return DeviceMesh.from_group([rep, sh], "cpu", mesh=MESH, mesh_dim_names=NAMES)
    if variant == "initpg_wrapped":
        rep = wrap_and_register(rep, dist.PrefixStore(f"{prefix}/rep/", store), f"{prefix}_rep_{rr[0]}", rr, rank)
        sh = wrap_and_register(sh, dist.PrefixStore(f"{prefix}/sh/", store), f"{prefix}_shard_{sr[0]}", sr, rank)
        return DeviceMesh.from_group([rep, sh], "cpu", mesh=MESH, mesh_dim_names=NAMES)
    if variant == "fromgroup":
        return DeviceMesh.from_group([rep, sh], "cpu", mesh=MESH, mesh_dim_names=NAMES)
    if variant == "manual":
        rep = wrap_and_register(rep, dist.PrefixStore(f"{prefix}/rep/", store), f"{prefix}_rep_{rr[0]}", rr, rank)
        sh = wrap_and_register(sh, dist.PrefixStore(f"{prefix}/sh/", store), f"{prefix}_shard_{sr[0]}", sr, rank)
        mesh = DeviceMesh("cpu", torch.tensor(MESH), mesh_dim_names=NAMES, _init_backend=False, _rank=rank)
        mesh._dim_group_names = [rep.group_name, sh.group_name]
        mesh._pg_registry[rep.group_name] = rep
        mesh._pg_registry[sh.group_name] = sh
        return mesh
    raise ValueError(variant)


def make_fsdp(mesh, seed=0):
    model = tiny_model(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model, opt, step, rank):
    x, y = batch(step, rank)  # data-parallel index = global rank (4-way DP)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def worker(rank, world, store, variant):
    mesh = build_mesh(variant, rank, world, store)
    model, opt = make_fsdp(mesh)
    losses = [train_step(model, opt, s, rank) for s in range(STEPS)]
    p0 = next(iter(model.parameters()))
    info = dict(mesh=str(mesh), coord=mesh.get_coordinate(), param_type=type(p0).__name__,
                placements=str(p0.placements), local_shape=tuple(p0.to_local().shape), losses=losses)
    local = {n: p.to_local().clone() for n, p in model.named_parameters()}
    full = {n: p.full_tensor().clone() for n, p in model.named_parameters()}  # collective on the mesh
    if dist.is_initialized():
        dist.destroy_process_group()
    return info, local, full


def reference():
    """Single process: same init, the 4 ranks' batches concatenated (mean loss == mean of per-rank grads)."""
    model = tiny_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(STEPS):
        xs, ys = zip(*[batch(s, r) for r in range(4)])
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step(); opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


if __name__ == "__main__":
    variant = sys.argv[1] if len(sys.argv) > 1 else "initpg"
    out = launch(worker, extra=(variant,))
    for r in sorted(out):
        st, res = out[r]
        if st != "ok":
            print(f"rank {r} FAILED: {res}")
            continue
        print(f"rank {r}: {res[0]}")
    if all(out.get(r, ("err",))[0] == "ok" for r in range(4)):
        loc = {r: out[r][1][2] for r in range(4)}
        for a, b in [(0, 2), (1, 3)]:
            same = all(torch.equal(loc[a][n], loc[b][n]) for n in loc[a])
            print(f"replicas {a} and {b} (same shard position) have bitwise-equal local shards: {same}")
        ref = reference()
        full = out[0][1][2]
        err = max((full[n] - ref[n]).abs().max().item() for n in ref)
        print(f"max |full_tensor - single-process reference| after {STEPS} steps = {err:.3e}")
