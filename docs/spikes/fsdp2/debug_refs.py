"""Who still references a generation's DeviceMesh (and so its gloo groups) after the module is dropped?"""
import gc
from hsdp import *
from torch.distributed.device_mesh import DeviceMesh


CLEAR = os.environ.get("CLEAR") == "1"


def worker(rank, world, store):
    global CLEAR
    mesh = init_generation(store, 0, rank, world)
    model, opt = build(mesh)
    train_step(model, opt, 0, rank)
    state = local_state(model, opt)
    del model, opt, mesh
    gc.collect()
    dist.destroy_process_group()
    if CLEAR:
        clear_dtensor_caches()
    gc.collect()
    meshes = [o for o in gc.get_objects() if isinstance(o, DeviceMesh)]
    out = [f"{len(meshes)} DeviceMesh objects alive"]
    for m in meshes[:3]:
        for r in gc.get_referrers(m):
            if r is meshes:
                continue
            desc = type(r).__name__
            if isinstance(r, dict):
                keys = list(r.keys())[:6]
                owners = [type(o).__name__ for o in gc.get_referrers(r) if o is not meshes][:4]
                desc += f" keys={keys} owners={owners}"
            out.append(f"  mesh {id(m)} <- {desc[:300]}")
    return out


if __name__ == "__main__":
    out = launch(worker, extra=())
    print(*out[0][1], sep="\n") if out[0][0] == "ok" else print(out[0][1])
