from common import *
from q1_hsdp_train import build_mesh, make_fsdp, train_step
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, StateDictOptions

def worker(rank, world, store):
    mesh = build_mesh("initpg", rank, world, store)
    model, opt = make_fsdp(mesh)
    train_step(model, opt, 0, rank)
    lines = []
    for k, v in model.state_dict().items():
        lines.append(f"model.state_dict {k}: {type(v).__name__} {tuple(v.shape)} local={tuple(v.to_local().shape)} {v.placements}")
    p = next(iter(model.parameters()))
    lines.append(f"to_local shares storage with _local_tensor: {p.to_local().data_ptr() == p._local_tensor.data_ptr()}")
    for k, v in opt.state[p].items():
        lines.append(f"opt.state[p0] {k}: {type(v).__name__} {tuple(v.shape)} {getattr(v, 'placements', '')}")
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=False))
    lines.append(f"get_optimizer_state_dict keys: {list(osd['state'])[:2]} ... {list(osd['state']['0.weight'])}")
    dist.destroy_process_group()
    return lines

if __name__ == "__main__":
    out = launch(worker)
    for r in (0, 3):
        print(r, *out[r][1], sep="\n  ") if out[r][0] == "ok" else print(out[r])
