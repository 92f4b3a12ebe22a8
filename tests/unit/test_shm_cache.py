"""The /dev/shm batch cache: no directory scan per write, page-true budget, consumed batches dropped,
directory created by the first write only, a full /dev/shm skipped (not fatal)."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from checkpointless.corpus.cached_dataset import CachedDataset
from checkpointless.corpus.shm_cache import ShmBatchCache

Batch = tuple[torch.Tensor, torch.Tensor]


class _Steps:
    """A pure batch source: every id encodes (step, rank), so a batch shows where it came from."""

    def __init__(self) -> None:
        self.calls = 0

    def batch(self, step: int, dp_rank: int, dp_size: int, *, split: str = "train") -> Batch:
        self.calls += 1
        x = torch.full((2, 16), step * 10 + dp_rank, dtype=torch.int64)
        return x, x + 1


class _Untouchable:
    def batch(self, step: int, dp_rank: int, dp_size: int, *, split: str = "train") -> Batch:
        raise AssertionError("the dataset was touched although the batch was cached")


def _du(path: Path) -> int:
    """What ``du`` reports for the batch files: allocated blocks."""
    return sum(os.stat(p).st_blocks * 512 for p in path.iterdir())


def _steps_on_disk(path: Path, rank: int = 0, size: int = 2, split: str = "train") -> list[int]:
    suffix = f"-r{rank}-of{size}.npy"
    return sorted(
        int(p.name[len(split) + 2 : -len(suffix)])
        for p in path.iterdir()
        if p.name.startswith(f"{split}-s") and p.name.endswith(suffix)
    )


@pytest.fixture
def count_scans(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Count directory listings at the OS boundary (os.scandir / os.listdir)."""
    calls = [0]
    real_scandir, real_listdir = os.scandir, os.listdir

    def scandir(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real_scandir(*args, **kwargs)

    def listdir(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real_listdir(*args, **kwargs)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "listdir", listdir)
    return lambda: calls[0]


@pytest.fixture(params=["tmp", "shm"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A temp dir, and /dev/shm itself (tmpfs, where page accounting matters) when writable."""
    if request.param == "tmp":
        yield tmp_path
        return
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        pytest.skip("no writable /dev/shm")
    yield shm


@pytest.mark.timeout(30)
def test_writes_do_not_scan_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count_scans: Callable[[], int]
) -> None:
    job = tmp_path / "checkpointless-many"
    job.mkdir()
    batch = np.zeros((2, 2, 16), dtype=np.uint16)
    for step in range(3000):  # batches another process left behind
        np.save(job / ShmBatchCache.filename(step, 1, 2), batch)
    monkeypatch.setattr(ShmBatchCache, "rescan_interval_s", 3600.0, raising=False)
    cache = ShmBatchCache("many", root=tmp_path, budget_bytes=1 << 40)
    x = torch.zeros(2, 16, dtype=torch.int64)
    before = count_scans()
    for step in range(3000, 3200):
        assert cache.put(step, 0, 2, (x, x))
    assert count_scans() - before <= 1  # at most the first write's scan, never one per write
    # nbytes() rescans on demand and counts everyone's files, in whole pages
    assert cache.nbytes() == 3200 * 4096
    assert count_scans() - before <= 2


@pytest.mark.timeout(30)
def test_usage_in_pages_stays_within_budget(root: Path) -> None:
    budget = 64 * 1024
    x = torch.randint(0, 257, (1, 32))  # ~0.3 KB of data: one 4 KiB page on tmpfs
    with ShmBatchCache(f"pages-{os.getpid()}", root=root, budget_bytes=budget) as cache:
        for step in range(100):
            cache.put(step, 0, 1, (x, x))
        assert _du(cache.path) <= budget
        assert sum(-(-p.stat().st_size // 4096) * 4096 for p in cache.path.iterdir()) <= budget
        assert _steps_on_disk(cache.path, 0, 1) == list(range(84, 100))  # the 16 newest pages' worth
        assert cache.nbytes() == 16 * 4096


@pytest.mark.timeout(30)
def test_consumed_batches_are_dropped_current_step_kept(tmp_path: Path) -> None:
    cache = ShmBatchCache("consume", root=tmp_path)
    data = CachedDataset(_Steps(), cache)
    data.prefetch(range(8), 0, 2, background=False)
    data.prefetch(range(8), 1, 2, background=False)  # another rank's batches (same node)
    data.prefetch(range(2), 0, 1, split="val", background=False)
    for step in range(6):
        x, _ = data.batch(step, 0, 2)
        assert int(x[0, 0]) == step * 10
        # everything below the step being trained on is gone; the step itself stays for a replacement
        assert _steps_on_disk(cache.path, 0, 2) == list(range(step, 8))
    assert data.hits == 6
    assert _steps_on_disk(cache.path, 1, 2) == list(range(8))  # other ranks' batches are theirs
    assert _steps_on_disk(cache.path, 0, 1, split="val") == [0, 1]  # eval batches are reused
    for _ in range(3):
        data.batch(0, 0, 1, split="val")
    assert _steps_on_disk(cache.path, 0, 1, split="val") == [0, 1]
    # a replacement re-executing step 5 of rank 0 finds its batch
    replacement = CachedDataset(_Untouchable(), ShmBatchCache("consume", root=tmp_path))  # type: ignore[arg-type]
    assert int(replacement.batch(5, 0, 2)[0][0, 0]) == 50
    data.stop()
    cache.cleanup()


@pytest.mark.timeout(30)
def test_replacement_drops_what_its_predecessor_prefetched(tmp_path: Path) -> None:
    dead = CachedDataset(_Steps(), ShmBatchCache("handover", root=tmp_path))
    dead.prefetch(range(6), 1, 2, background=False)
    dead.batch(0, 1, 2)
    dead.batch(1, 1, 2)  # ... and the process dies during step 1
    assert _steps_on_disk(tmp_path / "checkpointless-handover", 1, 2) == [1, 2, 3, 4, 5]
    fresh = ShmBatchCache("handover", root=tmp_path)
    replacement = CachedDataset(_Untouchable(), fresh)  # type: ignore[arg-type]
    for step in (1, 2, 3):
        assert int(replacement.batch(step, 1, 2)[0][0, 0]) == step * 10 + 1
    assert _steps_on_disk(fresh.path, 1, 2) == [3, 4, 5]
    fresh.cleanup()


@pytest.mark.timeout(30)
def test_directory_is_created_by_the_first_write_only(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    root.mkdir()
    cache = ShmBatchCache("lazy", root=root)
    assert cache.get(0, 0, 1) is None
    assert not cache.contains(0, 0, 1)
    assert cache.nbytes() == 0
    assert list(root.iterdir()) == []
    assert cache.drop_before(5, 0, 1) == 0
    reader = CachedDataset(_Untouchable(), cache)  # type: ignore[arg-type]
    reader.prefetch([], 0, 1, background=False)
    assert list(root.iterdir()) == []  # constructing and reading leave nothing behind
    x = torch.ones(2, 8, dtype=torch.int64)
    assert cache.put(0, 0, 1, (x, x))
    assert cache.path.is_dir() and stat.S_IMODE(cache.path.stat().st_mode) == 0o700
    late = ShmBatchCache("lazy", root=root)  # sees the directory, then the owner cleans up
    assert late.get(0, 0, 1) is not None
    cache.cleanup()
    assert not late.put(1, 0, 1, (x, x))
    assert list(root.iterdir()) == []  # a handle that saw the directory does not resurrect it


# ------------------------------------------------------------------ a full /dev/shm


class _Wide(_Steps):
    """Batches of 16 KiB on disk (uint16): four pages, more than a nearly full tmpfs has left."""

    def batch(self, step: int, dp_rank: int, dp_size: int, *, split: str = "train") -> Batch:
        self.calls += 1
        x = torch.full((4, 1024), step * 10 + dp_rank, dtype=torch.int64)
        return x, x + 1


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB tmpfs (a container's /dev/shm, shrunk), mounted for the test and unmounted after."""
    disk = tmp_path / "shm"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                       capture_output=True, text=True, timeout=20)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {r.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=20)


def _fill(disk: Path, leave_pages: int) -> Path:
    """Fill ``disk`` up but ``leave_pages`` free pages; the filler file (delete it to make room)."""
    filler = disk / "filler"
    st = os.statvfs(disk)
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail - leave_pages) * st.f_bsize)
    assert os.statvfs(disk).f_bavail == leave_pages
    return filler


@pytest.mark.timeout(30)
@pytest.mark.parametrize("leave_pages", [1, 0], ids=["short-write", "enospc"])
def test_a_full_shm_skips_the_cache_and_serves_from_the_source(
    small_tmpfs: Path, leave_pages: int, caplog: pytest.LogCaptureFixture
) -> None:
    """What a 64 MB container /dev/shm did to every worker and spare (``OSError: 4096 requested and
    1984 written``): now the batch is served from its source, one warning names the directory and
    its free space, and nothing is left half-written."""
    filler = _fill(small_tmpfs, leave_pages)
    cache = ShmBatchCache("full", root=small_tmpfs, budget_bytes=1 << 30)
    source = _Wide()
    data = CachedDataset(source, cache)
    with caplog.at_level(logging.WARNING, logger="checkpointless.corpus.shm_cache"):
        for step in range(5):
            x, y = data.batch(step, 0, 1)
            assert int(x[0, 0]) == step * 10 and torch.equal(y, x + 1)
        data.prefetch(range(5, 8), 0, 1, background=False)  # raises nothing either
    assert source.calls == 8 and data.misses == 5
    assert cache.write_failures == 1  # the first failure; later writes are skipped, not tried
    (warning,) = [r.getMessage() for r in caplog.records]
    assert str(small_tmpfs) in warning and "MiB free of 0.1 MiB" in warning, warning
    assert "read from the source" in warning and "--shm-size" in warning, warning
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["checkpointless-full", "filler"]
    assert list(cache.path.iterdir()) == []  # no partial batch, no temporary file
    # a handle that tries again at once writes as soon as there is room again
    again = ShmBatchCache("full", root=small_tmpfs, budget_bytes=1 << 30)
    again.retry_after_s = 0.0
    assert not again.put(9, 0, 1, source.batch(9, 0, 1)) and again.write_failures == 1
    filler.unlink()
    assert again.put(9, 0, 1, source.batch(9, 0, 1))
    assert int(CachedDataset(_Untouchable(), again).batch(9, 0, 1)[0][0, 0]) == 90  # type: ignore[arg-type]
    again.cleanup()
