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

from checkpointless.protocol.env import ENV_STORE

pytest.importorskip("lightning")

import lightning as L
from lightning.pytorch.callbacks import GradientAccumulationScheduler
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


class _OneRanksShare(torch.utils.data.Sampler[int]):
    """A sampler of the script's own that yields one rank's share (as a DistributedSampler does)."""

    num_replicas, rank = 2, 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(0, 40, 2))

    def __len__(self) -> int:
        return 20


class _Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(_Points()[i] for i in range(40))


class _Regression(L.LightningModule):
    def __init__(self, manual: bool = False, dropout: float = 0.3) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Dropout(dropout), torch.nn.Linear(8, 1)
        )
        self.automatic_optimization = not manual

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 2)]


class _Validated(_Regression):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)


class _OwnOptimizerStep(_Regression):
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)


def _fit(
    tmp_path: Path, loader: Any = None, manual: bool = False, module: L.LightningModule | None = None,
    val: Any = None, **trainer: Any,
) -> CheckpointlessStrategy:  # fmt: skip
    torch.manual_seed(0)
    strategy = CheckpointlessStrategy(seed=5)
    options: dict[str, Any] = {"max_epochs": 2, "accelerator": "cpu", "logger": False, "enable_progress_bar": False,
                               "enable_model_summary": False, "enable_checkpointing": False}  # fmt: skip
    t = L.Trainer(strategy=strategy, default_root_dir=tmp_path, **{**options, **trainer})
    t.fit(
        module if module is not None else _Regression(manual),
        loader if loader is not None else DataLoader(_Points(), batch_size=8, shuffle=True),
        val,
    )
    return strategy


def test_alone_it_trains_on_one_process_and_is_reproducible(tmp_path: Path) -> None:
    a = _fit(tmp_path / "a")
    b = _fit(tmp_path / "b")
    assert a.session is not None and a.session.world_size == 1
    assert a.session.committed_step == 9  # 2 epochs of 40 samples in batches of 8
    assert a.digest is not None and a.digest == b.digest
    assert torch.distributed.get_world_size() == 1  # the session's group of one (no env:// group)


class _Recording(_Regression):
    def __init__(self) -> None:
        super().__init__(dropout=0.0)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch[0].clone())
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("limit", [None, 2], ids=["one-endless-epoch", "epochs-of-2-batches"])
def test_a_stream_is_read_in_its_order_one_global_batch_after_the_other(
    tmp_path: Path, limit: int | None
) -> None:
    """An ``IterableDataset`` without ``__len__`` (with ``max_steps``): step ``s`` reads samples
    ``[8s, 8s + 8)`` of the stream, in one endless epoch or across the Trainer's epochs of
    ``limit_train_batches`` batches (the stream goes on; it does not start again)."""
    module = _Recording()
    options: dict[str, Any] = {"max_steps": 4, "max_epochs": -1}
    if limit is not None:
        options["limit_train_batches"] = limit
    s = _fit(tmp_path, DataLoader(_Stream(), batch_size=8), module=module, **options)
    assert s.session is not None and s.session.committed_step == 3
    points = _Points()
    assert len(module.seen) == 4
    for step, x in enumerate(module.seen):
        torch.testing.assert_close(x, torch.stack([points[i][0] for i in range(8 * step, 8 * step + 8)]))


def test_limit_train_batches_reads_each_epoch_from_its_start(tmp_path: Path) -> None:
    s = _fit(tmp_path, limit_train_batches=3)
    assert s.session is not None and s.session.committed_step == 5


def test_accumulated_micro_batches_make_one_step_of_their_samples(tmp_path: Path) -> None:
    """Two micro-batches of 4 samples per optimizer step (one session step, one reduction) train
    as one batch of 8 does, to rounding: the same samples, the loss halved per micro-batch; an
    epoch of 5 batches of 8 samples ends with a step of one micro-batch. Reproducible."""
    points = _Points()

    def fit(name: str, batch: int, accumulate: int) -> tuple[CheckpointlessStrategy, list[torch.Tensor]]:
        torch.manual_seed(0)
        module = _Regression(dropout=0.0)
        s = _fit(tmp_path / name, DataLoader(points, batch_size=batch, shuffle=True), module=module,
                 accumulate_grad_batches=accumulate)  # fmt: skip
        return s, [p.detach().clone() for p in module.parameters()]

    (one, p1), (two, p2), (again, _) = fit("one", 8, 1), fit("two", 4, 2), fit("again", 4, 2)
    for s in (one, two):
        assert s.session is not None and s.session.committed_step == 9  # 2 epochs of 5 steps
    for a, b in zip(p1, p2, strict=True):
        torch.testing.assert_close(a, b)
    assert two.digest == again.digest and two.digest != one.digest  # summed in another order

    odd, _ = fit("odd", 8, 2)  # 5 batches per epoch: steps of 2, 2 and 1 micro-batches
    assert odd.session is not None and odd.session.committed_step == 5


@pytest.mark.parametrize(
    ("options", "loader", "message"),
    [
        ({"manual": True}, None, "manual optimization"),
        (
            {"accumulate_grad_batches": 2, "module": _OwnOptimizerStep()},
            None,
            "accumulate_grad_batches=2 with a LightningModule.optimizer_step of its own",
        ),
        ({"callbacks": [GradientAccumulationScheduler({0: 2})]}, None, "GradientAccumulationScheduler"),
        (
            {
                "accumulate_grad_batches": 2,
                "val_check_interval": 3,
                "module": _Validated(),
                "val": DataLoader(_Points(8), batch_size=4),
            },
            None,
            "validation inside an accumulated step (accumulate_grad_batches=2, validation every 3 batches",
        ),
        ({"max_epochs": -1}, None, "training without an end"),
        ({"overfit_batches": 2}, None, "overfit_batches"),
        (
            {},
            DataLoader(_Stream(), batch_size=8),
            "an IterableDataset without __len__ as the train set without max_steps",
        ),
        (
            {"max_steps": 3},
            DataLoader(_Stream(), batch_size=8, num_workers=2),
            "num_workers=2 with an IterableDataset",
        ),
        ({}, DataLoader(_Points(), batch_sampler=[[0, 1], [2, 3]]), "without batch_size"),
        ({}, DataLoader(_Points(), batch_size=8, sampler=_OneRanksShare()), "gives one rank's share"),
    ],
    ids=[
        "manual",
        "accumulate-own-optimizer-step",
        "accumulation-scheduler",
        "validation-inside-a-step",
        "endless",
        "overfit",
        "endless-stream",
        "stream-workers",
        "batch-sampler",
        "sampler",
    ],
)
def test_an_unsupported_feature_is_refused_in_one_line(
    tmp_path: Path, options: dict[str, Any], loader: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=r"^CheckpointlessStrategy does not support ") as e:
        _fit(tmp_path, loader, **options)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_collectives_run_over_the_sessions_group_and_fall_back_to_the_ranks_own_after_a_failure() -> None:
    """Two ranks (threads, real gloo group): ``reduce`` (mean, sum, max), ``all_gather``, ``broadcast``
    (scalars only: nothing received is unpickled) and ``barrier`` between steps; inside a share's
    pass a collective is this rank's own; the group dropped by a peer makes every collective this
    rank's own until the next step."""

    class _Session:  # what the strategy reads of its session: the group and the rank
        def __init__(self, group: Group) -> None:
            self.process_group, self.rank, self.world_size = group, group.rank, group.world_size

    def rank_fn(rank: int, store: TCPStore) -> Any:
        group = Group(store, 0, rank, 2, prefix="lightning/")
        s = CheckpointlessStrategy()
        s._session, s._comm.aligned = _Session(group), True  # type: ignore[assignment]
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
        if rank == 0:  # a share's pass that rank 1 does not run (it holds fewer shares): rank 0's own
            s._comm.in_step = s._comm.in_share = True
            out["share"] = s.reduce(t, reduce_op="sum").tolist()
            s._comm.in_step = s._comm.in_share = False
        s.barrier()
        if rank == 1:
            group.abort()  # a peer leaves between steps
            return out
        out["after"] = s.reduce(t, reduce_op="sum").tolist()  # fails: rank 0's own value
        out["aligned"] = s._comm.aligned
        return out

    r0, r1 = run_ranks(2, rank_fn)
    for r in (r0, r1):
        assert r["mean"] == [1.5, 5.0] and r["sum"] == [3.0, 10.0] and r["max"] == [2.0, 10.0]
        assert r["gather"] == [[1.0, 0.0], [2.0, 10.0]]
        assert r["path"] == "/runs/version_0" and r["flag"] is True
    assert (r0["object"], r1["object"]) == ([0], [1])
    assert r0["share"] == [1.0, 0.0]
    assert r0["after"] == [1.0, 0.0] and r0["aligned"] is False


def test_the_pinned_versions_are_the_ones_installed_and_supported() -> None:
    """``pyproject.toml``'s ``lightning`` extra is ``SUPPORTED``, and the installed Lightning (what
    the tests ran with) is inside it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (req,) = [Requirement(r) for r in extras["lightning"]]
    low, high = integration.SUPPORTED
    assert req.name == "lightning" and str(req.specifier) == f"<{high},>={low}"
    assert low <= Version(L.__version__) < high


def test_lightnings_sigterm_broadcasts_over_the_default_group_are_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session's generation is the default group: Lightning's per-batch SIGTERM broadcast and
    its handler's broadcast would run outside the step (where a replacement pairs them with its
    peers' next collective). The handler only notes the signal."""
    from checkpointless.integrations.lightning.launched import SigtermNoted

    trainer = _fit(tmp_path)._trainer
    assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor() is None
    noted = trainer._signal_connector._sigterm_notifier_fn
    assert isinstance(noted, SigtermNoted)
    noted(15, None)
    assert trainer._signal_connector.received_sigterm  # alone, Lightning stops at the next batch
    trainer._signal_connector.received_sigterm = False
    monkeypatch.setenv(ENV_STORE, "127.0.0.1:1")  # under the launcher: a preemption notice
    noted(15, None)
    assert not trainer._signal_connector.received_sigterm  # the rank is handed over instead
