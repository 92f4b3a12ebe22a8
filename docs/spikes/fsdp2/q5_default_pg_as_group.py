"""Side check: the per-generation default ProcessGroup offers the same pybind calls comm.Group uses on its
raw ProcessGroupGloo (pg.send([t], dst, tag), pg.recv, pg.allreduce([t])), so state.py could run on it."""
from hsdp import *
from torch.distributed import distributed_c10d as c10d


def worker(rank, world, store):
    init_generation(store, 0, rank, world)
    pg = c10d._get_default_group()
    t = torch.full((3,), float(rank))
    pg.allreduce([t]).wait()
    ok_ar = t.tolist() == [6.0] * 3
    if rank == 1:
        pg.send([torch.arange(4.0)], 3, 7).wait()
    got = None
    if rank == 3:
        got = torch.empty(4)
        pg.recv([got], 1, 7).wait()
        got = got.tolist()
    end_generation()
    return type(pg).__name__, ok_ar, got


if __name__ == "__main__":
    out = launch(worker)
    print({r: out[r][1] for r in sorted(out)})
