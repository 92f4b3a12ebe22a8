"""The demo's synthetic data: a step's global batch does not depend on how many ranks split it."""

from __future__ import annotations

import pytest
import torch

from checkpointless.cli import main
from checkpointless.corpus.synthetic import SyntheticTokens

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("sizes", [(1, 2), (2, 4), (3, 6), (1, 12)])
def test_global_batch_is_independent_of_the_split(sizes: tuple[int, int]) -> None:
    data = SyntheticTokens(seed=3, vocab_size=64, seq_len=16, global_batch=12)
    for step in (0, 7):
        joined = [
            torch.cat([data.batch(step, r, n)[part] for r in range(n)]) for n in sizes for part in (0, 1)
        ]
        assert torch.equal(joined[0], joined[2]) and torch.equal(joined[1], joined[3])
    assert not torch.equal(data.batch(0, 0, 1)[0], data.batch(1, 0, 1)[0])


def test_uneven_split_and_bad_rank_are_refused() -> None:
    data = SyntheticTokens(seed=0, vocab_size=8, seq_len=4, global_batch=12)
    with pytest.raises(ValueError, match="not divisible"):
        data.batch(0, 0, 5)
    with pytest.raises(ValueError, match="dp_rank=2"):
        data.batch(0, 2, 2)


@pytest.mark.slow
def test_demo_accepts_three_workers(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--workers", "3", "--spares", "0", "--steps", "2", "--fault", "none", "--quiet",
               "--d-model", "32", "--layers", "1"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "global batch 18" in err
