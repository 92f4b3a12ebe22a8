"""``StepLoader`` (``session.loader``): a map-style dataset read as a function of the step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from checkpointless.loaders.loader import StepLoader
from checkpointless.loaders.options import LoaderOptions

pytestmark = pytest.mark.timeout(120)


class Counted(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples ``i -> (i, 2i)``; counts the reads (in this process)."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        return torch.tensor(i), torch.tensor(2 * i)


def _loader(dataset: Any, g: int, rank: int = 0, size: int = 1, **kw: Any) -> StepLoader:
    return StepLoader(dataset, g, LoaderOptions(**kw), rank=lambda: rank, size=lambda: size)


def test_the_global_batch_is_a_function_of_the_step_whatever_the_number_of_ranks() -> None:
    ds = Counted(50)
    whole = _loader(ds, 12, seed=3)
    for step in (0, 3, 4, 9, 17):
        batch = whole.global_indices(step)
        assert len(batch) == 12 and len(set(batch)) == 12
        for size in (1, 2, 3, 4, 6):
            parts = [i for r in range(size) for i in _loader(ds, 12, r, size, seed=3).indices(step)]
            assert parts == batch  # the ranks' parts, in rank order, are the global batch
    # an epoch (4 steps of 12 of the 50 samples: the last 2 left out) sees each sample at most once
    epoch0 = [i for s in range(4) for i in whole.global_indices(s)]
    assert len(set(epoch0)) == 48 and len(whole) == 4
    assert whole.global_indices(4) != whole.global_indices(0)  # epoch 1: another order
    assert whole.global_indices(5) == _loader(ds, 12, seed=3).global_indices(5)  # same seed: same order
    assert _loader(ds, 12, seed=4).global_indices(0) != whole.global_indices(0)
    assert _loader(ds, 12, shuffle=False).global_indices(1) == list(range(12, 24))


def test_an_order_given_per_epoch_is_the_epochs_order_and_a_wrong_one_is_named() -> None:
    """``order(epoch)`` (a length-grouped order, a curriculum): the epoch's order, cut into global
    batches and split over the ranks as a shuffle is; not a permutation of the dataset: one line."""
    ds = Counted(20)

    def reverse_then_rotate(epoch: int) -> list[int]:
        return [(19 - i + epoch) % 20 for i in range(20)]

    loader = _loader(ds, 4, 1, 2, order=reverse_then_rotate, seed=3)
    assert loader.global_indices(0) == [19, 18, 17, 16] and loader.indices(0) == [17, 16]
    assert loader.global_indices(5) == [0, 19, 18, 17]  # epoch 1, rotated by one
    assert [int(x) for x in loader.batch(5)[0]] == [18, 17]
    for bad, named in ((lambda e: [0, 1, 2], "got 3 values"), (lambda e: [0] * 20, "each of 0..19 once"),
                       (lambda e: ["a"] * 20, "must return sample indices")):  # fmt: skip
        with pytest.raises(ValueError, match=named):
            _loader(ds, 4, order=bad).global_indices(0)

    # an order drawn from the global generator (or one that runs on) is not the epoch's alone
    with pytest.raises(ValueError, match="two different orders: it must be a function of the epoch alone"):
        _loader(ds, 4, order=lambda e: torch.randperm(20).tolist()).global_indices(0)

    class Stream(IterableDataset[int]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(8)

    from checkpointless.loaders.from_dataloader import make_loader

    with pytest.raises(TypeError, match=r"order=.*map-style"):
        make_loader(Stream(), 4, LoaderOptions(order=reverse_then_rotate), rank=lambda: 0, size=lambda: 1,
                    default_seed=0)  # fmt: skip


def test_consecutive_steps_keep_the_iterator_and_a_step_asked_again_restarts_it() -> None:
    ds = Counted(40)
    loader = _loader(ds, 8, 1, 2, seed=0)
    first = [loader.batch(s) for s in range(3)]
    assert ds.reads == 3 * 4  # each sample read once: no re-reading from the epoch's start
    for s, (x, y) in enumerate(first):
        assert x.tolist() == loader.indices(s) and torch.equal(y, 2 * x)
    again = loader.batch(1)  # re-executed after a recovery: the same batch
    assert torch.equal(again[0], first[1][0]) and ds.reads == 4 * 4
    assert torch.equal(loader.batch(2)[0], first[2][0])  # and on from there


def test_worker_processes_deliver_the_same_batches() -> None:
    data = TensorDataset(torch.arange(64.0).unsqueeze(1))
    inline = _loader(data, 16, 0, 2, seed=1)
    workers = _loader(data, 16, 0, 2, seed=1, num_workers=2)
    try:
        for step in (0, 1, 2, 5, 6):
            assert torch.equal(workers.batch(step)[0], inline.batch(step)[0])
    finally:
        workers.close()


def test_a_short_last_batch_without_drop_last_and_bad_input() -> None:
    ds = Counted(10)
    loader = _loader(ds, 4, drop_last=False, shuffle=False)
    assert len(loader) == 3 and loader.global_indices(2) == [8, 9]
    with pytest.raises(ValueError, match="cannot share evenly"):
        _loader(ds, 4, 0, 3).indices(0)
    # told when the loader is made (session.loader), not at the first step that cannot be shared
    with pytest.raises(ValueError, match=r"^the global batch has 4 samples, which 3 data-parallel ranks"):
        _loader(ds, 4).check_split(3)
    with pytest.raises(ValueError, match=r"^an epoch's last batch has 2 samples, which 4 .*drop_last=True"):
        _loader(ds, 4, drop_last=False).check_split(4)
    _loader(ds, 4, drop_last=False).check_split(2)  # 4 and 2 both split in two
    _loader(ds, 4).check_split(4)  # the short tail is dropped

    class Stream(IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(5))

    with pytest.raises(TypeError, match="map-style dataset"):
        _loader(Stream(), 2)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        _loader(Counted(3), 4)
    with pytest.raises(ValueError, match="at least 1"):
        _loader(ds, 0)


_ORPHAN_SCRIPT = """
import sys, time, torch
from checkpointless.loaders.loader import StepLoader
from checkpointless.loaders.options import LoaderOptions
data = torch.utils.data.TensorDataset(torch.arange(64.0))
loader = StepLoader(data, 8, LoaderOptions(num_workers=2), rank=lambda: 0, size=lambda: 1)
loader.batch(0)
print("ready", flush=True)
time.sleep(60)
"""


def _holding(token: str) -> list[int]:
    """Pids of the live processes whose environment carries ``token``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if token.encode() in (d / "environ").read_bytes():
                    out.append(int(d.name))
            except OSError:
                continue
    return out


@pytest.mark.timeout(60)
def test_worker_processes_die_with_a_killed_training_process() -> None:
    """SIGKILL of the training process (a kill fault) takes its fork server and loader workers along
    (their parent is the fork server: torch's own check watched that, and both stayed behind)."""
    import uuid

    token = f"CHECKPOINTLESS_ORPHAN_TEST={uuid.uuid4().hex}"
    name, value = token.split("=")
    env = {**os.environ, name: value, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert len(_holding(token)) >= 3  # itself, the fork server, its workers
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _holding(token) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _holding(token)
    finally:
        proc.kill()
        for pid in _holding(token):
            os.kill(pid, signal.SIGKILL)
    assert left == [], left


def test_restarting_the_iterator_draws_nothing_from_the_global_generator() -> None:
    """A step executed again after a recovery makes its iterator anew inside the step, after the
    session reseeded the global generator: a draw there (a DataLoader's workers' base seed) would
    shift the step's dropout away from the uninterrupted run's."""
    from tests.unit.test_iterable_loader import Stream
    from tests.unit.test_iterable_loader import _loader as iterable_loader

    for loader in (_loader(Counted(40), 8, seed=0), iterable_loader(Stream(100), 4)):
        loader.batch(0)
        for step in (3, 1, 1):  # a jump, a step asked again, and again
            torch.manual_seed(7)
            loader.batch(step)  # made anew here
            drawn = torch.rand(2)
            torch.manual_seed(7)
            assert torch.equal(drawn, torch.rand(2)), type(loader).__name__


class Augmented(Dataset[torch.Tensor]):
    """Sample ``i`` plus a random transform drawn from the three global generators, and what the
    worker's ``worker_init_fn`` left (``TAG``)."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        import random

        import numpy as np

        noise = [*torch.rand(2).tolist(), random.random(), float(np.random.rand())]
        return torch.tensor([float(i), *noise, float(os.environ.get("TAG", "0"))], dtype=torch.float64)


def tag_worker(worker_id: int) -> None:
    os.environ["TAG"] = "7"


def test_a_samples_random_transform_depends_on_its_place_in_the_job_not_on_who_reads_it() -> None:
    """A dataset's random transforms are drawn under a seed of (seed, step, position): a loader
    restarted at a step (after a recovery) draws what the uninterrupted one drew there, with 0 or 2
    worker processes, over 1 or 2 ranks; the training process's own generators are left as they
    were; the script's worker_init_fn runs in each worker."""
    ds = Augmented()
    whole = _loader(ds, 8, seed=5)
    torch.manual_seed(1)
    expected_draw = torch.rand(3)
    torch.manual_seed(1)
    straight = [whole.batch(s) for s in range(5)]  # in this process: its generators untouched
    assert torch.equal(torch.rand(3), expected_draw)
    assert not torch.equal(straight[3][:, 1:3], straight[4][:, 1:3])  # the draws differ by sample
    restarted = _loader(ds, 8, seed=5, num_workers=2, worker_init_fn=tag_worker)
    halves = [_loader(ds, 8, r, 2, seed=5, num_workers=2) for r in range(2)]
    try:
        for s in (3, 4, 1):  # asked out of order: restarted at 3, then at 1
            got = restarted.batch(s)
            assert torch.equal(got[:, :5], straight[s][:, :5]), s
            assert got[:, 5].eq(7).all()  # the worker_init_fn ran in its workers
            parts = torch.cat([h.batch(s) for h in halves])
            assert torch.equal(parts[:, :5], straight[s][:, :5]), s
    finally:
        restarted.close()
        for h in halves:
            h.close()
    assert not torch.equal(_loader(ds, 8, seed=6).batch(0)[:, 1:5], straight[0][:, 1:5])  # another seed


def test_a_caller_that_keeps_the_generators_itself_gets_the_same_samples() -> None:
    """``generators_kept``: the Lightning strategy saves and restores the three generators around a
    batch itself (it seeds them for the batch first); the samples inside are seeded by their place
    as without it, and the loader leaves the generators where the samples left them (no second save
    and restore), which the caller's one restore undoes."""
    import random

    import numpy as np

    from checkpointless.loaders.sample_seeds import (
        generator_states,
        generators_kept,
        restore_generators,
        seed_all,
    )

    ds = Augmented()
    expected = [_loader(ds, 8, seed=5).batch(s) for s in range(3)]
    loader = _loader(ds, 8, seed=5)
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    before = torch.get_rng_state(), random.random(), float(np.random.rand())
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    for step in range(3):
        saved = generator_states()
        try:
            seed_all(1000 + step)
            with generators_kept():
                got = loader.batch(step)
                inside = torch.get_rng_state()
        finally:
            restore_generators(saved)
        assert torch.equal(got, expected[step])
        seed_all(1000 + step)
        assert not torch.equal(inside, torch.get_rng_state())  # left where the samples left it
        restore_generators(saved)
    assert (torch.get_rng_state(), random.random(), float(np.random.rand()))[1:] == before[1:]
    assert torch.equal(torch.get_rng_state(), before[0])


class RarelyDrawn(Dataset[torch.Tensor]):
    """Sample ``i``; only sample ``DRAWS_AT`` draws, and from one generator (``source``). Counts reads."""

    DRAWS_AT = 29

    def __init__(self, source: str) -> None:
        self.source, self.reads = source, 0

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        import random

        import numpy as np

        self.reads += 1
        noise = 0.0
        if i == self.DRAWS_AT:
            draw = {"torch": lambda: torch.rand(1).item(), "random": random.random, "numpy": np.random.rand}
            noise = float(draw[self.source]())
        return torch.tensor([float(i), noise], dtype=torch.float64)


@pytest.mark.parametrize("source", ["torch", "random", "numpy"])
def test_a_sample_that_draws_from_one_generator_alone_is_still_seeded_by_its_place(source: str) -> None:
    """Parts are read under one seeding and looked at afterwards: a part where a single sample drew
    from a single generator is read again under per-sample seeds, so the sample's draw depends on
    its place in the job, not on which rank's part holds it (1 rank or 2, with its draw first or last
    in the part); a dataset that draws nothing is read once per sample."""
    steps = range(0, 6)  # 8 samples a step, 48 in all: sample DRAWS_AT is in one of them
    whole = RarelyDrawn(source)
    straight = torch.cat([_loader(whole, 8, seed=5, shuffle=False).batch(s) for s in steps])
    drawn = straight[straight[:, 0] == RarelyDrawn.DRAWS_AT, 1]
    assert drawn.numel() == 1 and drawn.item() != 0.0
    for size in (2, 4):
        halves = [_loader(RarelyDrawn(source), 8, r, size, seed=5, shuffle=False) for r in range(size)]
        split = torch.cat([torch.cat([h.batch(s) for h in halves]) for s in steps])
        assert torch.equal(split, straight), size
    quiet = Counted(48)
    loader = _loader(quiet, 8, seed=5)
    for s in steps:
        loader.batch(s)
    assert quiet.reads == 48


class WorkerPids(Dataset[torch.Tensor]):
    """Sample ``i`` and the pid of the process that read it."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, os.getpid()])


def test_a_step_read_again_keeps_the_worker_processes() -> None:
    """A step asked again (a recovery's re-execution) or an earlier one resets the loader's worker
    processes to it (what they prefetched is dropped) rather than starting new ones; the batches are
    the ones the uninterrupted reading gave; ``close`` ends the workers."""
    loader = _loader(WorkerPids(), 8, seed=3, num_workers=2)
    try:
        first = [loader.batch(s) for s in range(4)]
        pids = {int(p) for b in first for p in b[:, 1]}
        assert len(pids) == 2 and os.getpid() not in pids
        for s in (3, 1, 2, 3):  # 3 again, then back to 1 (a resumed start)
            again = loader.batch(s)
            assert torch.equal(again[:, 0], first[s][:, 0]), s
            assert {int(p) for p in again[:, 1]} <= pids, s  # the same processes
    finally:
        loader.close()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


def test_a_replica_holding_several_shares_reads_each_and_keeps_their_workers() -> None:
    """``batch(step, share=p)`` reads part ``p`` whatever the current ``dp_rank`` (the rank's 0
    here), as a rank ``p`` loader does; reading two shares in turn, step after step, keeps both
    parts' worker processes instead of starting new ones at each switch; ``close`` ends them all."""
    loader = _loader(WorkerPids(), 8, rank=0, size=2, seed=3, num_workers=1)
    other = _loader(WorkerPids(), 8, rank=1, size=2, seed=3)
    try:
        seen: dict[int, set[int]] = {0: set(), 1: set()}
        for step in range(4):
            for share in (0, 1):
                got = loader.batch(step, share=share)
                want = (other if share else _loader(WorkerPids(), 8, rank=0, size=2, seed=3)).batch(step)
                assert torch.equal(got[:, 0], want[:, 0]), (step, share)
                seen[share] |= {int(p) for p in got[:, 1]}
        assert len(seen[0]) == len(seen[1]) == 1 and seen[0] != seen[1]  # one worker each, kept
        assert torch.equal(loader.batch(1)[:, 0], loader.batch(1, share=0)[:, 0])  # the current one: 0
    finally:
        loader.close()
    pids = seen[0] | seen[1]
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
