"""``checkpointless.integrations.transformers.Trainer``'s refusals: each ``TrainingArguments`` setting
the checkpointless loop cannot honour is named in one line (what the loop reads is tested end to end
in tests/integration/test_hf_trainer.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.timeout(120)


def _trainer(**args: Any) -> Any:
    defaults = dict(deepspeed=None, fsdp=None, n_gpu=1, auto_find_batch_size=False, parallelism_config=None,
                    train_sampling_strategy="random", dataloader_num_workers=0, max_steps=-1)  # fmt: skip
    return SimpleNamespace(
        args=SimpleNamespace(**{**defaults, **args}),
        train_dataset=torch.utils.data.TensorDataset(torch.zeros(4)),
    )


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"train_sampling_strategy": "batch_rebalance"}, "train_sampling_strategy='batch_rebalance'"),
        ({"deepspeed": "ds.json"}, "DeepSpeed"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
    ],
)
def test_a_setting_the_loop_cannot_honour_is_named(args: dict[str, Any], named: str) -> None:
    from checkpointless.integrations.transformers import refusals

    (line,) = refusals(_trainer(**args))
    assert line.startswith(named), line


def test_the_default_sequential_and_length_grouped_orders_are_supported() -> None:
    from checkpointless.integrations.transformers import refusals

    assert refusals(_trainer()) == []
    assert refusals(_trainer(train_sampling_strategy="sequential")) == []
    assert refusals(_trainer(train_sampling_strategy="group_by_length")) == []


class _Varied(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.zeros(self.lengths[i], dtype=torch.long)}


def test_the_length_grouped_order_is_hfs_drawn_from_the_seed_and_the_epoch() -> None:
    """``group_by_length``: each epoch's order is what HF's ``LengthGroupedSampler`` draws with a
    generator seeded from (seed, epoch), grouped by the global micro-batch; the same in every
    process (a function of its arguments), another in each epoch."""
    from transformers.trainer_pt_utils import LengthGroupedSampler

    from checkpointless.integrations.hf_parts import length_grouped_order

    lengths = torch.randint(1, 64, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    trainer = SimpleNamespace(args=SimpleNamespace(length_column_name="length"), processing_class=None)
    order = length_grouped_order(trainer, _Varied(lengths), 8, seed=5)
    assert order(0) == length_grouped_order(trainer, _Varied(lengths), 8, seed=5)(0)
    assert sorted(order(0)) == list(range(200)) and order(0) != order(1)
    hf = LengthGroupedSampler(8, lengths=lengths, generator=torch.Generator().manual_seed(5 * 1_000_003 + 1))
    assert order(1) == list(hf)

    # the micro-batches are alike in length: far less padding than in a random order
    def padding(o: list[int]) -> int:
        return sum(max(lengths[i] for i in o[k : k + 8]) * 8 - sum(lengths[i] for i in o[k : k + 8])
                   for k in range(0, 200, 8))  # fmt: skip

    shuffled = torch.randperm(200, generator=torch.Generator().manual_seed(1)).tolist()
    assert padding(order(0)) < padding(shuffled) / 3


class _OwnLoader(SimpleNamespace):
    def get_train_dataloader(self) -> Any:  # a script's Trainer subclass reading its own way
        return None


class _OwnSampler(SimpleNamespace):
    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        return torch.utils.data.WeightedRandomSampler([3.0, 1.0, 1.0, 1.0], 6)


def test_a_train_dataloader_of_the_scripts_own_is_refused_and_a_sampler_of_its_own_is_read() -> None:
    """A ``get_train_dataloader`` override would be bypassed by the step's loader: refused in one line
    (before, it was silently not used). A ``_get_train_sampler`` override gives the epochs' orders
    (``sampler_order``): its draws, 6 an epoch, the same for the same (seed, epoch)."""
    from checkpointless.integrations.hf_parts import own_sampler_order
    from checkpointless.integrations.transformers import refusals

    plain = _trainer()
    (line,) = refusals(_OwnLoader(**vars(plain)))
    assert line.startswith("a get_train_dataloader of its own") and "_get_train_sampler" in line, line
    assert own_sampler_order(plain, plain.train_dataset, 5) == (None, None)
    own = _OwnSampler(**vars(plain))
    order, samples = own_sampler_order(own, own.train_dataset, 5)
    assert samples == 6 and order is not None
    assert order(0) == own_sampler_order(own, own.train_dataset, 5)[0](0)  # type: ignore[misc]
    assert len(order(0)) == 6 and set(order(0)) <= {0, 1, 2, 3}
    assert [order(e) for e in range(4)] != [order(0)] * 4  # each epoch its own draws
