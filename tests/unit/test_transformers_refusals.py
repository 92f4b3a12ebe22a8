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
        ({"train_sampling_strategy": "group_by_length"}, "train_sampling_strategy='group_by_length'"),
        ({"train_sampling_strategy": "batch_rebalance"}, "train_sampling_strategy='batch_rebalance'"),
        ({"deepspeed": "ds.json"}, "DeepSpeed"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
    ],
)
def test_a_setting_the_loop_cannot_honour_is_named(args: dict[str, Any], named: str) -> None:
    from checkpointless.integrations.transformers import _refusals

    (line,) = _refusals(_trainer(**args))
    assert line.startswith(named), line


def test_the_default_and_sequential_order_are_supported() -> None:
    from checkpointless.integrations.transformers import _refusals

    assert _refusals(_trainer()) == []
    assert _refusals(_trainer(train_sampling_strategy="sequential")) == []
