"""``CheckpointlessStrategy`` in-process: one process with no launcher (the session's single-process
mode), the refusals, the collectives over a real two-rank gloo group (ranks are threads), and the
Lightning versions it is pinned to. The recovery itself runs in real processes:
``tests/integration/test_lightning.py``."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore
from torch.utils.data import DataLoader, Dataset, IterableDataset

pytest.importorskip("lightning")

import lightning as L
from packaging.requirements import Requirement
from packaging.version import Version

from checkpointless.comm import Group
from checkpointless.integrations import lightning as integration
from checkpointless.integrations.lightning import CheckpointlessStrategy
from tests.unit.test_reducer import run_ranks

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


class _Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int = 40) -> None:
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class _Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(_Points()[i] for i in range(40))


class _Regression(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
        self.automatic_optimization = not manual

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 2)]


def _fit(tmp_path: Path, loader: Any = None, manual: bool = False, **trainer: Any) -> CheckpointlessStrategy:
    torch.manual_seed(0)
    strategy = CheckpointlessStrategy(seed=5)
    options: dict[str, Any] = {"max_epochs": 2, "accelerator": "cpu", "logger": False, "enable_progress_bar": False,
                               "enable_model_summary": False, "enable_checkpointing": False}  # fmt: skip
    t = L.Trainer(strategy=strategy, default_root_dir=tmp_path, **{**options, **trainer})
    t.fit(
        _Regression(manual),
        loader if loader is not None else DataLoader(_Points(), batch_size=8, shuffle=True),
    )
    return strategy


def test_alone_it_trains_on_one_process_and_is_reproducible(tmp_path: Path) -> None:
    a = _fit(tmp_path / "a")
    b = _fit(tmp_path / "b")
    assert a.session is not None and a.session.world_size == 1
    assert a.session.committed_step == 9  # 2 epochs of 40 samples in batches of 8
    assert a.digest is not None and a.digest == b.digest
    assert not torch.distributed.is_initialized()


def test_limit_train_batches_reads_each_epoch_from_its_start(tmp_path: Path) -> None:
    s = _fit(tmp_path, limit_train_batches=3)
    assert s.session is not None and s.session.committed_step == 5


@pytest.mark.parametrize(
    ("options", "loader", "message"),
    [
        ({"manual": True}, None, "manual optimization"),
        ({"accumulate_grad_batches": 2}, None, "accumulate_grad_batches=2"),
        ({"max_epochs": -1}, None, "training without an end"),
        ({"overfit_batches": 2}, None, "overfit_batches"),
        ({}, DataLoader(_Stream(), batch_size=8), "an IterableDataset as the train set"),
        ({}, DataLoader(_Points(), batch_sampler=[[0, 1], [2, 3]]), "without batch_size"),
        ({}, DataLoader(_Points(), batch_size=8, sampler=list(range(40))), "a sampler of its own"),
    ],
    ids=["manual", "accumulate", "endless", "overfit", "iterable", "batch-sampler", "sampler"],
)
def test_an_unsupported_feature_is_refused_in_one_line(
    tmp_path: Path, options: dict[str, Any], loader: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=r"^CheckpointlessStrategy does not support ") as e:
        _fit(tmp_path, loader, **options)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_collectives_run_over_the_sessions_group_and_fall_back_to_the_ranks_own_after_a_failure() -> None:
    """Two ranks (threads, real gloo group): ``reduce`` (mean, sum, max), ``all_gather``, ``broadcast``
    (scalars only: nothing received is unpickled) and ``barrier`` between steps; the group dropped
    by a peer makes every collective this rank's own until the next step."""

    class _Session:  # what the strategy reads of its session: the group and the rank
        def __init__(self, group: Group) -> None:
            self._group, self.rank, self.world_size = group, group.rank, group.world_size

    def rank_fn(rank: int, store: TCPStore) -> Any:
        group = Group(store, 0, rank, 2, prefix="lightning/")
        s = CheckpointlessStrategy()
        s._session, s._aligned = _Session(group), True  # type: ignore[assignment]
        t = torch.tensor([1.0 + rank, 10.0 * rank])
        out = {
            "mean": s.reduce(t).tolist(),
            "sum": s.reduce(t, reduce_op="sum").tolist(),
            "max": s.reduce(t, reduce_op="max").tolist(),
            "gather": s.all_gather(t).tolist(),
            "path": s.broadcast(f"/runs/version_{rank}"),
            "flag": s.broadcast(rank == 0),
            "object": s.broadcast([rank]),  # not a scalar: each rank's own
        }
        s.barrier()
        if rank == 1:
            group.abort()  # a peer leaves between steps
            return out
        out["after"] = s.reduce(t, reduce_op="sum").tolist()  # fails: rank 0's own value
        out["aligned"] = s._aligned
        return out

    r0, r1 = run_ranks(2, rank_fn)
    for r in (r0, r1):
        assert r["mean"] == [1.5, 5.0] and r["sum"] == [3.0, 10.0] and r["max"] == [2.0, 10.0]
        assert r["gather"] == [[1.0, 0.0], [2.0, 10.0]]
        assert r["path"] == "/runs/version_0" and r["flag"] is True
    assert (r0["object"], r1["object"]) == ([0], [1])
    assert r0["after"] == [1.0, 0.0] and r0["aligned"] is False


def test_the_pinned_versions_are_the_ones_installed_and_supported() -> None:
    """``pyproject.toml``'s ``lightning`` extra is ``SUPPORTED``, and the installed Lightning (what
    the tests ran with) is inside it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (req,) = [Requirement(r) for r in extras["lightning"]]
    low, high = integration.SUPPORTED
    assert req.name == "lightning" and str(req.specifier) == f"<{high},>={low}"
    assert low <= Version(L.__version__) < high
