"""The train ``DataLoader`` read as a function of the step (``Session.loader``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
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
    Trainer is at, each read by the session's ``StepLoader`` as a function of its position."""

    def __init__(
        self, strategy: CheckpointlessStrategy, trainer: Any, dataloader: DataLoader[Any], ranks: int
    ) -> None:
        """``ranks``: the data-parallel ranks (the session's; the job's workers when Lightning asks for
        the loader's length before the session exists, as ``estimated_stepping_batches`` does in
        ``configure_optimizers``). The rank is read from the session when a step is."""
        self._strategy, self._trainer = strategy, trainer
        self.dataset = dataloader.dataset
        # its settings as session.loader(dataloader) reads them (the shuffle seed: the strategy's)
        dataset, global_batch_size, options = loader_settings(dataloader, ranks, strategy.seed)
        self._loader = make_loader(
            dataset, global_batch_size, options, default_seed=strategy.seed,
            rank=lambda: self._session().dp_rank, size=lambda: self._session().dp_size,
        )  # fmt: skip

    def _session(self) -> Session:
        session = self._strategy.session
        assert session is not None, "the session is made in setup()"
        return session

    def __len__(self) -> int:
        return len(self._loader)  # a TypeError for a stream without __len__: Lightning's "no length"

    def __iter__(self) -> Iterator[Any]:
        """From the Trainer's ``global_step``: an epoch's start, or a replacement's first step (the
        first micro-batch of an accumulated step)."""
        trainer = self._trainer
        accumulate = trainer.accumulate_grad_batches
        try:
            per_epoch = len(self._loader)  # the data's epoch; the Trainer's may be shorter
        except TypeError:  # a stream without __len__: one endless epoch, or the Trainer's of
            limit = trainer.limit_train_batches  # limit_train_batches batches, one after the other
            if not isinstance(limit, int):
                return self._batches(0, trainer.global_step * accumulate, None)
            per_epoch = limit
        steps = math.ceil(trainer_epoch(trainer, per_epoch) / accumulate)  # an epoch's last may be shorter
        epoch, step = divmod(trainer.global_step, steps)
        return self._batches(epoch * per_epoch, step * accumulate, per_epoch)

    def _batches(self, base: int, first: int, per_epoch: int | None) -> Iterator[Any]:
        seed, rank = self._strategy.seed, self._strategy.global_rank
        for b in range(first, per_epoch) if per_epoch is not None else itertools.count(first):
            step = base + b
            # the dataset's own randomness (augmentation in the main process) is a function of the
            # step, not of when the Trainer prefetches it; the training RNG is left untouched
            # (the CPU generator's alone: torch.manual_seed would reseed an accelerator's too);
            # the samples' own seeding inside leaves the states to this one restore
            saved = generator_states()
            try:
                seed_all(step_seed(seed ^ 0x5EED, step, rank))
                with generators_kept():
                    batch = self._loader.batch(step)
            finally:
                restore_generators(saved)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Nothing: the position is the Trainer's step (this makes Lightning see a resumable loader)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        self._loader.close()


def trainer_epoch(trainer: Any, per_epoch: int) -> int:
    """Batches in one of the Trainer's epochs over ``per_epoch`` batches of data (``limit_train_batches``)."""
    limit = trainer.limit_train_batches
    batches = min(per_epoch, limit) if isinstance(limit, int) else int(per_epoch * limit)
    return max(1, batches)
