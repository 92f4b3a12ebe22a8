"""``session.loader(dataloader)``: a DDP script's own ``DataLoader`` (and its sampler) read as a
function of the step (``checkpointless.loaders.from_dataloader``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler

from checkpointless import Session
from checkpointless.loaders.from_dataloader import loader_settings
from checkpointless.loaders.loader import StepLoader

pytestmark = pytest.mark.timeout(120)

DATA = TensorDataset(torch.arange(40), torch.arange(40) * 2)


def _pad(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    return {"x": torch.stack([r[0] for r in rows]), "n": len(rows)}


def test_a_distributed_samplers_settings_become_the_step_loaders() -> None:
    sampler = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=True, seed=5)  # built for 2 ranks
    dl = DataLoader(DATA, batch_size=4, sampler=sampler, collate_fn=_pad, drop_last=True, num_workers=2,
                    worker_init_fn=_pad)  # fmt: skip
    dataset, global_batch_size, got = loader_settings(dl, dp_size=3, default_seed=0)
    assert dataset is DATA and global_batch_size == 12  # 4 per rank, over the ranks the session has
    assert (got.shuffle, got.seed, got.collate_fn, got.drop_last) == (True, 5, _pad, True)
    assert (got.num_workers, got.worker_init_fn) == (2, _pad)
    assert loader_settings(DataLoader(DATA, batch_size=2, shuffle=True), 1, 9)[2].seed == 9  # RandomSampler
    assert loader_settings(DataLoader(DATA, batch_size=2), 1, 9)[2].shuffle is False  # SequentialSampler
    sampler_drops = DistributedSampler(DATA, num_replicas=2, rank=0, drop_last=True)
    assert loader_settings(DataLoader(DATA, batch_size=2, sampler=sampler_drops), 1, 0)[2].drop_last is True


def test_session_loader_of_a_dataloader_reads_what_the_explicit_call_reads() -> None:
    session = Session(torch.nn.Linear(2, 2), None, seed=3)  # no launcher: one process
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True, seed=11)
    wrapped = session.loader(DataLoader(DATA, batch_size=8, sampler=sampler))
    explicit = session.loader(DATA, 8, shuffle=True, seed=11)
    assert isinstance(wrapped, StepLoader)
    for step in (0, 1, 4, 7, 2):  # across epochs (5 steps each), and back
        assert torch.equal(wrapped.batch(step)[0], explicit.batch(step)[0])


def test_a_sampler_of_another_kind_gives_each_epochs_order() -> None:
    """A weighted sampler, a ``RandomSampler`` with replacement: read as each epoch's draws
    (``sampler_order``), ``len(sampler)`` samples an epoch; the ``DataLoader`` never iterated."""
    weighted = DataLoader(DATA, batch_size=4, sampler=WeightedRandomSampler([1.0] * 40, 24))
    _, global_batch_size, got = loader_settings(weighted, 2, 0)
    assert got.epoch_samples == 24 and global_batch_size == 8
    assert got.order is not None and len(got.order(0)) == 24
    with_replacement = torch.utils.data.RandomSampler(DATA, True, num_samples=16)
    assert (
        loader_settings(DataLoader(DATA, batch_size=4, sampler=with_replacement), 1, 0)[2].epoch_samples == 16
    )
    session = Session(torch.nn.Linear(2, 2), None, seed=3)  # no launcher: one process
    loader = session.loader(weighted)
    assert isinstance(loader, StepLoader) and len(loader) == 6  # 24 draws in global batches of 4


def test_what_cannot_be_a_function_of_the_step_is_one_clear_error() -> None:
    own_batches = DataLoader(DATA, batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="batch_sampler of its own"):
        loader_settings(own_batches, 1, 0)

    class Reversed(DistributedSampler[int]):  # a subclass with an order of its own (HF has such)
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(reversed(list(super().__iter__())))

    with pytest.raises(ValueError, match=r"a Reversed, orders the samples its own way.*order=lambda epoch"):
        loader_settings(DataLoader(DATA, batch_size=4, sampler=Reversed(DATA, num_replicas=1, rank=0)), 1, 0)
    session = Session(torch.nn.Linear(2, 2), None)
    with pytest.raises(TypeError, match="takes its settings from the DataLoader"):
        session.loader(DataLoader(DATA, batch_size=4), 8)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="global_batch_size is missing"):
        session.loader(DATA)
