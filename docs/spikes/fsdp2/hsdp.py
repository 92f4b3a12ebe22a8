"""Minimal 'generation' helpers for FSDP2/HSDP on gloo (what the spike recommends).

init_generation : default group per generation on a fresh store prefix + 2x2 (replicate, shard) mesh
build           : fresh module (meta device, no init cost) -> fully_shard on the mesh -> to_empty -> AdamW
local_state     : this rank's shard only, as plain tensors (no DTensor), keyed by FQN
load_local_state: load such a dict back ("dcp": set_model/optimizer_state_dict, "copy": in place)
"""
from common import *
from torch.distributed.device_mesh import init_device_mesh, DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    set_model_state_dict, set_optimizer_state_dict)

NAMES = ("replicate", "shard")
SHARDED = StateDictOptions(full_state_dict=False)


def end_generation():
    """Drop this process's groups of the current generation. The caller must already have dropped its
    FSDP module / optimizer / mesh / DTensors of that generation: gloo closes a group's sockets (which
    releases peers blocked on it) only when the last reference goes, and DTensor's caches hold some."""
    if dist.is_initialized():
        dist.destroy_process_group()  # every group: shutdown + unregister (does NOT close gloo sockets)
    if os.environ.get("SPIKE_NO_CLEAR") != "1":  # ablation switch for q2_regen.py
        clear_dtensor_caches()
    import gc
    gc.collect()


def init_generation(store, gen, rank, world, shape=(2, 2), timeout=TIMEOUT):
    """Default group on a fresh per-generation store prefix, then one new_group per mesh row/column
    (explicit timeout: init_device_mesh's sub-groups would get gloo's 30-minute default), then
    DeviceMesh.from_group. Every rank creates every sub-group, in the same order (new_group's rule)."""
    end_generation()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{gen}/", store), rank=rank,
                            world_size=world, timeout=timeout)
    grid = torch.arange(world).reshape(shape)
    mine = {}
    for dim, lines in ((0, grid.T.tolist()), (1, grid.tolist())):  # dim 0: columns, dim 1: rows
        for ranks in lines:
            pg = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[dim] = pg
    return DeviceMesh.from_group([mine[0], mine[1]], "cpu", mesh=grid, mesh_dim_names=NAMES)


def build(mesh, seed=0, meta=False):
    if meta:
        with torch.device("meta"):
            model = tiny_model(seed)
    else:
        model = tiny_model(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if meta:
        model.to_empty(device="cpu")  # allocates only the local shards; values come from load_local_state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model, opt, step, rank):
    x, y = batch(step, rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _local(v):
    return (v.to_local() if isinstance(v, DTensor) else v).detach().clone()


def local_state(model, opt):
    """{'model/<fqn>': shard, 'optim/<fqn>/<key>': shard or scalar} -- plain CPU tensors only."""
    out = {f"model/{k}": _local(v) for k, v in get_model_state_dict(model, options=SHARDED).items()}
    osd = get_optimizer_state_dict(model, opt, options=SHARDED)
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/{fqn}/{k}"] = _local(v)
    return out  # (param_groups hyper-parameters are replicated python scalars: send as metadata)


def load_local_state(model, opt, state, how="dcp"):
    params = dict(model.named_parameters())

    def dt(fqn, t):  # re-wrap a local shard with the *current* mesh/placements of the parameter
        p = params[fqn]
        return DTensor.from_local(t.clone(), p.device_mesh, p.placements, shape=p.shape,
                                  stride=p.stride(), run_check=False)

    if how == "dcp":
        msd = {k[6:]: dt(k[6:], v) for k, v in state.items() if k.startswith("model/")}
        set_model_state_dict(model, msd, options=SHARDED)
        ost = {}
        for k, v in state.items():
            if k.startswith("optim/"):
                fqn, key = k[6:].rsplit("/", 1)
                ost.setdefault(fqn, {})[key] = v.clone() if key == "step" else dt(fqn, v)
        osd = get_optimizer_state_dict(model, opt, options=SHARDED)  # for param_groups (FQN-keyed)
        osd["state"] = ost
        set_optimizer_state_dict(model, opt, osd, options=SHARDED)
    elif how == "copy":
        with torch.no_grad():
            for fqn, p in params.items():
                p.to_local().copy_(state[f"model/{fqn}"])  # to_local() is a view of p._local_tensor
                keys = {k.rsplit("/", 1)[1] for k in state if k.startswith(f"optim/{fqn}/")}
                opt.state[p] = {key: (state[f"optim/{fqn}/{key}"].clone() if key == "step"
                                      else dt(fqn, state[f"optim/{fqn}/{key}"])) for key in keys}
    else:
        raise ValueError(how)


def send_state(state, dst, group=None):
    for k in sorted(state):
        dist.send(state[k].contiguous(), dst, group=group)


def recv_state(template, src, group=None):
    """template: the receiver's own local_state() (same shard position => same keys/shapes/dtypes)."""
    out = {}
    for k in sorted(template):
        t = torch.empty_like(template[k])
        dist.recv(t, src, group=group)
        out[k] = t
    return out


def same(a, b):
    """Bitwise equality of two {name: tensor} dicts (bytes, so -0.0 != 0.0 and NaN == NaN)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def clear_dtensor_caches():
    """DTensor caches keep DTensorSpec -> DeviceMesh -> ProcessGroup alive (so gloo sockets stay open)."""
    from torch.distributed.tensor import DTensor, debug
    from torch.distributed.tensor import _redistribute, _collective_utils
    debug._clear_sharding_prop_cache()  # python lru + C++ fast-path caches
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._planner_cache.clear()
    _redistribute._gen_transform_infos.cache_clear()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
