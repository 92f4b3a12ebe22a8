"""The train ``DataLoader`` read as a function of the step (``Session.loader``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader

from checkpointless.loaders.from_dataloader import loader_settings, make_loader
from checkpointless.loaders.sample_seeds import (
    generator_states,
    generators_kept,
    restore_generators,
    seed_all,
)
from checkpointless.seeds import step_seed
from checkpointless.session import Session

if TYPE_CHECKING:
    from checkpointless.integrations.lightning.strategy import CheckpointlessStrategy


class TrainBatches:
    """The train ``DataLoader`` as the Trainer iterates it: an epoch's batches from the one the
    Trainer is at, each read by the session's ``StepLoader`` as a function of its position; and,
    for a replica computing several shares, each share's batch of the step under way
    (``share_batch``)."""

    def __init__(
        self, strategy: CheckpointlessStrategy, trainer: Any, dataloader: DataLoader[Any], ranks: int
    ) -> None:
        """``ranks``: the data-parallel ranks, the job's shares (the session's ``dp_size``; the job's
        ``--shares`` when Lightning asks for the loader's length before the session exists, as ``estimated_stepping_batches`` does in
        ``configure_optimizers``). The rank is read from the session when a step is."""
        self._strategy, self._trainer = strategy, trainer
        self.dataset = dataloader.dataset
        # its settings as session.loader(dataloader) reads them (the shuffle seed: the strategy's)
        dataset, global_batch_size, options = loader_settings(dataloader, ranks, strategy.seed)
        self._settings = (dataset, global_batch_size, options)
        self._loader = self._make(lambda: self._session().dp_rank)
        self._shares: dict[int, Any] = {}  # a loader a share (``share_batch``), each read in step order

    def _make(self, part: Callable[[], int]) -> Any:
        """A ``StepLoader`` (or ``IterableStepLoader``) of the data-parallel part ``part()`` of the
        session's ``dp_size``."""
        dataset, global_batch_size, options = self._settings
        return make_loader(dataset, global_batch_size, options, default_seed=self._strategy.seed,
                           rank=part, size=lambda: self._session().dp_size)  # fmt: skip

    def _session(self) -> Session:
        session = self._strategy.session
        assert session is not None, "the session is made in setup()"
        return session

    def __len__(self) -> int:
        return len(self._loader)  # a TypeError for a stream without __len__: Lightning's "no length"

    def __iter__(self) -> Iterator[Any]:
        """From the Trainer's ``global_step``: an epoch's start, or a replacement's first step (the
        first micro-batch of an accumulated step)."""
        base, first, per_epoch = self._position(self._trainer.global_step)
        return self._batches(base, first, per_epoch)

    def _position(self, global_step: int) -> tuple[int, int, int | None]:
        """Where optimizer step ``global_step``'s first micro-batch is: its epoch's first batch in
        the data (``base``), its place in the epoch (``first``), the data's batches an epoch (None:
        an endless stream)."""
        trainer = self._trainer
        accumulate = trainer.accumulate_grad_batches
        try:
            per_epoch = len(self._loader)  # the data's epoch; the Trainer's may be shorter
        except TypeError:  # a stream without __len__: one endless epoch, or the Trainer's of
            limit = trainer.limit_train_batches  # limit_train_batches batches, one after the other
            if not isinstance(limit, int):
                return 0, global_step * accumulate, None
            per_epoch = limit
        steps = math.ceil(trainer_epoch(trainer, per_epoch) / accumulate)  # an epoch's last may be shorter
        epoch, step = divmod(global_step, steps)
        return epoch * per_epoch, step * accumulate, per_epoch

    def _batches(self, base: int, first: int, per_epoch: int | None) -> Iterator[Any]:
        rank = self._strategy.global_rank
        for b in range(first, per_epoch) if per_epoch is not None else itertools.count(first):
            yield self._read(self._loader, base + b, rank)

    def share_batch(self, global_step: int, share: int) -> Any:
        """Share ``share``'s batch of optimizer step ``global_step`` (one micro-batch a step), as
        the replica holding that share alone reads it: by a loader of the share's own, so that
        each share's batches are read in step order (a loader moved from part to part would start
        its iterator again at every pass); loaders of shares no longer held are closed by
        ``close``."""
        loader = self._shares.get(share)
        if loader is None:
            loader = self._shares[share] = self._make(lambda: share)
        base, first, _ = self._position(global_step)
        return self._read(loader, base + first, share)

    def _read(self, loader: Any, step: int, part: int) -> Any:
        """``loader``'s batch of data step ``step``, the dataset's own randomness (augmentation in the
        main process) a function of the step and the part, not of when the Trainer prefetches it;
        the training RNG is left untouched (the CPU generator's alone: torch.manual_seed would
        reseed an accelerator's too); the samples' own seeding inside leaves the states to this
        one restore."""
        saved = generator_states()
        try:
            seed_all(step_seed(self._strategy.seed ^ 0x5EED, step, part))
            with generators_kept():
                return loader.batch(step)
        finally:
            restore_generators(saved)

    def state_dict(self) -> dict[str, Any]:
        """Nothing: the position is the Trainer's step (this makes Lightning see a resumable loader)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        self._loader.close()
        for loader in self._shares.values():
            loader.close()
        self._shares.clear()


def trainer_epoch(trainer: Any, per_epoch: int) -> int:
    """Batches in one of the Trainer's epochs over ``per_epoch`` batches of data (``limit_train_batches``)."""
    limit = trainer.limit_train_batches
    batches = min(per_epoch, limit) if isinstance(limit, int) else int(per_epoch * limit)
    return max(1, batches)
