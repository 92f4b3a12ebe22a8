"""Tests for the real-text data pipeline: tokenized corpus cache, stateless batches, shm batch cache."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.corpus import (
    BYTE_VOCAB_SIZE,
    EOD_ID,
    TokenDataset,
    TokenizedCorpus,
    load_corpus,
)
from checkpointless.corpus.cached_dataset import CachedDataset
from checkpointless.corpus.sampling import _permute, _round_keys
from checkpointless.corpus.shm_cache import ShmBatchCache

REPO = Path(__file__).resolve().parents[2]


def _write_corpus(root: Path, n_docs: int = 24) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    suffixes = [".txt", ".md", ".py"]
    for i in range(n_docs):
        lines = [f"document {i} line {j}: value={i * 1000 + j * 7} ok" for j in range(40)]
        (root / f"doc_{i:03d}{suffixes[i % 3]}").write_text("\n".join(lines) + "\n")
    (root / "ignored.bin").write_bytes(b"\x00\x01")  # not a corpus suffix
    return root


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    return _write_corpus(tmp_path / "corpus")


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "tokens"


def _ds(corpus_dir: Path, cache_dir: Path, **kw: object) -> TokenDataset:
    params: dict[str, object] = {"seq_len": 32, "global_batch": 8, "seed": 1234, "val_fraction": 0.1}
    params.update(kw)
    return TokenDataset(corpus_dir, cache_dir=cache_dir, **params)  # type: ignore[arg-type]


def _digest(batch: tuple[torch.Tensor, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in batch:
        h.update(t.numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Corpus and token cache
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_byte_tokens_roundtrip_and_eod(corpus_dir: Path, cache_dir: Path) -> None:
    corpus = load_corpus(corpus_dir, cache_dir=cache_dir)
    assert corpus.vocab_size == BYTE_VOCAB_SIZE and corpus.eod_id == EOD_ID
    assert corpus.tokens.dtype == np.uint16
    assert corpus.n_docs == 24
    expected = b"".join(p.read_bytes() + b"\n" for p in sorted(corpus_dir.glob("doc_*")))
    # every document is followed by exactly one EOD token; decode renders EOD as a blank line
    assert int((np.asarray(corpus.tokens) == EOD_ID).sum()) == 24
    assert np.asarray(corpus.tokens)[np.asarray(corpus.doc_starts)[1:] - 1].tolist() == [EOD_ID] * 23
    first = corpus.tokens[: corpus.doc_starts[1] - 1]
    assert bytes(np.asarray(first, dtype=np.uint8)) == (corpus_dir / "doc_000.txt").read_bytes()
    assert len(corpus) == len(expected)


@pytest.mark.timeout(30)
def test_cache_reuse_does_not_retokenize(corpus_dir: Path, cache_dir: Path) -> None:
    first = load_corpus(corpus_dir, cache_dir=cache_dir)
    assert not first.from_cache
    token_file = first.path / "tokens.bin"
    mtime = token_file.stat().st_mtime_ns
    second = load_corpus(corpus_dir, cache_dir=cache_dir)
    assert second.from_cache
    assert second.path == first.path and second.key == first.key
    assert token_file.stat().st_mtime_ns == mtime
    assert [p.name for p in cache_dir.iterdir() if p.is_dir()] == [first.key]  # no temp leftovers


@pytest.mark.timeout(30)
def test_content_change_gives_new_key(corpus_dir: Path, cache_dir: Path) -> None:
    before = load_corpus(corpus_dir, cache_dir=cache_dir)
    doc = corpus_dir / "doc_004.md"
    st_before = doc.stat()
    text = doc.read_text()
    doc.write_text(text.replace("document 4", "DOCUMENT 4"))  # same size ...
    os.utime(doc, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))  # ... and same mtime
    after = load_corpus(corpus_dir, cache_dir=cache_dir)
    assert after.key != before.key and not after.from_cache
    # adding a file changes the key too; tokenizer settings are part of the key
    (corpus_dir / "extra.txt").write_text("more text\n")
    assert load_corpus(corpus_dir, cache_dir=cache_dir).key not in (before.key, after.key)


@pytest.mark.timeout(30)
def test_concurrent_builders_publish_one_entry(corpus_dir: Path, cache_dir: Path) -> None:
    results: list[TokenizedCorpus] = []
    lock = threading.Lock()

    def build() -> None:
        c = load_corpus(corpus_dir, cache_dir=cache_dir)
        with lock:
            results.append(c)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    assert len({c.key for c in results}) == 1
    assert sum(not c.from_cache for c in results) == 1
    ref = np.asarray(results[0].tokens)
    assert all(np.array_equal(np.asarray(c.tokens), ref) for c in results)


@pytest.mark.timeout(30)
def test_jsonl_input(tmp_path: Path, cache_dir: Path) -> None:
    root = tmp_path / "jsonl"
    root.mkdir()
    records = [{"text": f"record number {i} " * 20, "id": i} for i in range(10)]
    (root / "data.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    corpus = load_corpus(root, cache_dir=cache_dir)
    assert corpus.n_docs == 10
    assert corpus.decode(corpus.tokens[: corpus.doc_starts[1]]) == str(records[0]["text"]) + "\n\n"
    ds = TokenDataset(corpus, seq_len=16, global_batch=4, val_fraction=0.2)
    x, _ = ds.batch(0, 0, 1)
    assert x.shape == (4, 16)

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:2"):
        load_corpus(bad, cache_dir=cache_dir)


@pytest.mark.timeout(30)
def test_bad_paths_raise_value_error_naming_path(tmp_path: Path, cache_dir: Path) -> None:
    missing = tmp_path / "does-not-exist"
    with pytest.raises(ValueError) as info:
        load_corpus(missing, cache_dir=cache_dir)
    assert str(missing) in str(info.value)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError) as info:
        TokenDataset(empty, seq_len=8, global_batch=2, cache_dir=cache_dir)
    assert str(empty) in str(info.value)

    only_other = tmp_path / "other"
    only_other.mkdir()
    (only_other / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError) as info:
        load_corpus(only_other, cache_dir=cache_dir)
    assert str(only_other) in str(info.value)


@pytest.mark.timeout(30)
def test_argument_validation(corpus_dir: Path, cache_dir: Path) -> None:
    ds = _ds(corpus_dir, cache_dir, global_batch=6)
    with pytest.raises(ValueError, match="global_batch=6"):
        ds.batch(0, 0, 4)
    with pytest.raises(ValueError, match="dp_rank"):
        ds.batch(0, 3, 3)
    with pytest.raises(ValueError, match="step"):
        ds.batch(-1, 0, 1)
    with pytest.raises(ValueError, match="split"):
        ds.batch(0, 0, 1, split="test")
    with pytest.raises(ValueError, match="seq_len"):
        _ds(corpus_dir, cache_dir, seq_len=100_000)
    no_val = _ds(corpus_dir, cache_dir, val_fraction=0.0)
    with pytest.raises(ValueError, match="val"):
        no_val.eval_batches(1)
    with pytest.raises(ValueError, match="tokenizer"):
        load_corpus(corpus_dir, cache_dir=cache_dir, tokenizer="words")  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_bpe_tokenizer(corpus_dir: Path, cache_dir: Path) -> None:
    pytest.importorskip("tokenizers")
    ds = _ds(corpus_dir, cache_dir, tokenizer="bpe", vocab_size=400)
    corpus = ds.corpus
    assert corpus.tokenizer == "bpe" and 257 <= corpus.vocab_size <= 400
    assert len(corpus) < sum(p.stat().st_size for p in corpus_dir.glob("doc_*"))  # it compresses
    first_doc = corpus.tokens[: corpus.doc_starts[1] - 1]
    assert corpus.decode(first_doc) == (corpus_dir / "doc_000.txt").read_text()
    x, _ = ds.batch(3, 0, 2)
    assert int(x.max()) < corpus.vocab_size
    assert load_corpus(corpus_dir, cache_dir=cache_dir, tokenizer="bpe", vocab_size=400).from_cache
    assert load_corpus(corpus_dir, cache_dir=cache_dir).key != corpus.key  # byte entry is separate


# ---------------------------------------------------------------------------------------------
# Stateless batches
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_batch_shape_dtype_and_shift(corpus_dir: Path, cache_dir: Path) -> None:
    ds = _ds(corpus_dir, cache_dir)
    x, y = ds.batch(7, 1, 2)
    assert x.shape == y.shape == (4, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < ds.vocab_size and int(x.min()) >= 0


@pytest.mark.timeout(60)
def test_batch_is_pure_function_including_fresh_process(corpus_dir: Path, cache_dir: Path) -> None:
    ds = _ds(corpus_dir, cache_dir)
    ref = {step: _digest(ds.batch(step, 1, 4)) for step in (0, 5, 1000)}
    # same object, later, after other calls: unchanged
    ds.batch(3, 0, 4)
    assert {s: _digest(ds.batch(s, 1, 4)) for s in ref} == ref
    # a new instance (as a replacement process would build)
    assert {s: _digest(_ds(corpus_dir, cache_dir).batch(s, 1, 4)) for s in ref} == ref
    # another seed gives another stream
    assert _digest(_ds(corpus_dir, cache_dir, seed=99).batch(0, 1, 4)) != ref[0]
    # a fresh interpreter, jumping straight to the steps
    code = (
        "import hashlib, json, sys\n"
        "from checkpointless.corpus import TokenDataset\n"
        "ds = TokenDataset(sys.argv[1], cache_dir=sys.argv[2], seq_len=32, global_batch=8, seed=1234,"
        " val_fraction=0.1)\n"
        "out = {}\n"
        "for s in (1000, 5, 0):\n"
        "    h = hashlib.sha256()\n"
        "    for t in ds.batch(s, 1, 4):\n"
        "        h.update(t.numpy().tobytes())\n"
        "    out[s] = h.hexdigest()\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(corpus_dir), str(cache_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=50,
        check=True,
    )
    child = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    assert child == ref


@pytest.mark.timeout(30)
def test_ranks_get_different_data_and_cover_global_batch(corpus_dir: Path, cache_dir: Path) -> None:
    ds = _ds(corpus_dir, cache_dir, global_batch=8)
    for step in (0, 1, 17):
        full_x, full_y = ds.batch(step, 0, 1)
        for dp_size in (2, 4, 8):
            parts = [ds.batch(step, r, dp_size) for r in range(dp_size)]
            assert all(p[0].shape == (8 // dp_size, 32) for p in parts)
            assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
            assert torch.equal(torch.cat([p[1] for p in parts]), full_y)
            digests = {_digest(p) for p in parts}
            assert len(digests) == dp_size  # every rank sees different samples
    # consecutive steps differ too
    assert _digest(ds.batch(0, 0, 2)) != _digest(ds.batch(1, 0, 2))


@pytest.mark.timeout(30)
def test_epoch_visits_every_window_once(corpus_dir: Path, cache_dir: Path) -> None:
    ds = _ds(corpus_dir, cache_dir, global_batch=1, val_fraction=0.0)
    n = ds.num_windows("train")
    tokens = torch.from_numpy(np.asarray(ds.corpus.tokens, dtype=np.int64))
    expected = {tuple(tokens[w * 32 : w * 32 + 32].tolist()) for w in range(n)}
    seen = [tuple(ds.batch(s, 0, 1)[0][0].tolist()) for s in range(n)]
    assert set(seen) == expected and len(set(seen)) == n
    # the next epoch is a different order of the same windows
    nxt = [tuple(ds.batch(s, 0, 1)[0][0].tolist()) for s in range(n, 2 * n)]
    assert set(nxt) == expected and nxt != seen


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**40), epoch=st.integers(0, 50))
@pytest.mark.timeout(60)
def test_permute_is_a_bijection(n: int, seed: int, epoch: int) -> None:
    out = _permute(np.arange(n, dtype=np.int64), n, _round_keys(seed, "train", epoch))
    assert np.array_equal(np.sort(out), np.arange(n))


@pytest.mark.timeout(30)
def test_heldout_split_is_disjoint(tmp_path: Path, cache_dir: Path) -> None:
    root = tmp_path / "letters"
    root.mkdir()
    for i in range(20):  # document i is made only of letter i, so every token names its document
        (root / f"d{i:02d}.txt").write_text(chr(ord("A") + i) * 300)
    ds = TokenDataset(root, cache_dir=cache_dir, seq_len=16, global_batch=8, val_fraction=0.2)
    assert ds.val_start == int(ds.corpus.doc_starts[16])  # last 4 of 20 equal documents
    train_letters = {ord("A") + i for i in range(16)} | {EOD_ID}
    val_letters = {ord("A") + i for i in range(16, 20)} | {EOD_ID}
    for step in range(40):
        x, y = ds.batch(step, 0, 1)
        assert set(torch.cat([x, y]).unique().tolist()) <= train_letters
    evals = ds.eval_batches(10, 0, 2)
    assert len(evals) == 10
    for x, y in evals:
        assert set(torch.cat([x, y]).unique().tolist()) <= val_letters
        assert x.shape == (4, 16)
    # a fixed set: identical on every call and in a new instance
    again = TokenDataset(root, cache_dir=cache_dir, seq_len=16, global_batch=8, val_fraction=0.2)
    assert [_digest(b) for b in again.eval_batches(10, 0, 2)] == [_digest(b) for b in evals]


@pytest.mark.timeout(30)
def test_dataset_pickles_without_copying_tokens(corpus_dir: Path, cache_dir: Path) -> None:
    import pickle

    ds = _ds(corpus_dir, cache_dir)
    blob = pickle.dumps(ds)
    assert len(blob) < 10_000
    clone = pickle.loads(blob)
    assert _digest(clone.batch(4, 1, 2)) == _digest(ds.batch(4, 1, 2))


@pytest.mark.timeout(60)
def test_stdlib_default_corpus(cache_dir: Path) -> None:
    ds = TokenDataset(seq_len=128, global_batch=16, cache_dir=cache_dir)
    corpus = ds.corpus
    assert corpus.n_docs > 500 and len(corpus) > 5_000_000
    x, _ = ds.batch(0, 0, 2)
    assert x.shape == (8, 128)
    assert load_corpus(cache_dir=cache_dir).from_cache


# ---------------------------------------------------------------------------------------------
# Shared-memory batch cache
# ---------------------------------------------------------------------------------------------


class _Untouchable:
    """A batch source that fails the test if anything asks it for data."""

    def batch(
        self, step: int, dp_rank: int, dp_size: int, *, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("the dataset was touched although the batch was cached")


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[ShmBatchCache]:
    cache = ShmBatchCache(f"test-{os.getpid()}", root=tmp_path / "shm", budget_bytes=1 << 20)
    yield cache
    cache.cleanup()


@pytest.mark.timeout(30)
def test_shm_roundtrip_and_layout(shm: ShmBatchCache) -> None:
    x = torch.randint(0, 257, (4, 32))
    y = torch.randint(0, 257, (4, 32))
    assert shm.get(3, 1, 2) is None
    assert shm.put(3, 1, 2, (x, y))
    got = shm.get(3, 1, 2)
    assert got is not None and torch.equal(got[0], x) and torch.equal(got[1], y)
    assert got[0].dtype == torch.int64
    assert shm.get(3, 0, 2) is None and shm.get(3, 1, 2, split="val") is None
    assert shm.path.name == f"checkpointless-test-{os.getpid()}"
    assert sorted(p.name for p in shm.path.iterdir()) == ["train-s000000000003-r1-of2.npy"]
    # large ids are stored losslessly too
    big = torch.tensor([[70_000, 5]]), torch.tensor([[-1, 2**40]])
    assert shm.put(0, 0, 1, big)
    got = shm.get(0, 0, 1)
    assert got is not None and torch.equal(got[0], big[0]) and torch.equal(got[1], big[1])
    with pytest.raises(ValueError):
        ShmBatchCache("../escape", root=shm.path)


@pytest.mark.timeout(30)
def test_shm_hit_serves_without_dataset(corpus_dir: Path, cache_dir: Path, shm: ShmBatchCache) -> None:
    ds = _ds(corpus_dir, cache_dir)
    writer = CachedDataset(ds, shm)
    writer.prefetch(range(5), 1, 2, background=False)
    writer.prefetch(range(2), 0, 1, split="val", background=False)
    # a "replacement process": the dataset raises if touched, the factory must never run
    built: list[int] = []

    def factory() -> _Untouchable:
        built.append(1)
        return _Untouchable()

    for source in (_Untouchable(), factory):
        # each replacement consumes (and so drops) the train batches it moved past: cache them again
        writer.prefetch(range(5), 1, 2, background=False)
        replacement = CachedDataset(source, shm)  # type: ignore[arg-type]
        for step in range(5):
            assert _digest(replacement.batch(step, 1, 2)) == _digest(ds.batch(step, 1, 2))
        assert _digest(replacement.batch(1, 0, 1, split="val")) == _digest(ds.batch(1, 0, 1, split="val"))
        assert replacement.hits == 6 and replacement.misses == 0
    assert built == []
    # a miss falls through to the (lazily built) dataset and fills the cache
    lazy = CachedDataset(lambda: _ds(corpus_dir, cache_dir), shm)
    assert _digest(lazy.batch(9, 1, 2)) == _digest(ds.batch(9, 1, 2))
    assert lazy.misses == 1 and shm.contains(9, 1, 2)


@pytest.mark.timeout(30)
def test_shm_background_prefetch(corpus_dir: Path, cache_dir: Path, shm: ShmBatchCache) -> None:
    ds = _ds(corpus_dir, cache_dir)
    cached = CachedDataset(ds, shm)
    thread = cached.prefetch(range(10, 20), 0, 2)
    assert thread is not None
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert all(shm.contains(s, 0, 2) for s in range(10, 20))
    replacement = CachedDataset(_Untouchable(), shm)  # type: ignore[arg-type]
    assert _digest(replacement.batch(15, 0, 2)) == _digest(ds.batch(15, 0, 2))
    cached.stop(timeout=5)


@pytest.mark.timeout(30)
def test_shm_budget_evicts_oldest_steps(tmp_path: Path) -> None:
    x = torch.zeros(4, 64, dtype=torch.int64)
    probe = ShmBatchCache("probe", root=tmp_path)
    probe.put(0, 0, 1, (x, x))
    size = probe.nbytes()
    probe.cleanup()
    with ShmBatchCache("budget", root=tmp_path, budget_bytes=3 * size) as cache:
        for step in (5, 2, 9, 7):
            cache.put(step, 0, 1, (x, x))
        assert cache.nbytes() <= 3 * size
        assert [cache.contains(s, 0, 1) for s in (2, 5, 7, 9)] == [False, True, True, True]
        # a batch older than everything cached is itself the first to go
        assert not cache.put(1, 0, 1, (x, x))
        assert not cache.contains(1, 0, 1)
        # a batch larger than the whole budget is not stored
        huge = torch.zeros(64, 64, dtype=torch.int64)
        assert not cache.put(100, 0, 1, (huge, huge))
    assert not (tmp_path / "checkpointless-budget").exists()


@pytest.mark.timeout(30)
def test_shm_cleanup_removes_dir(tmp_path: Path) -> None:
    cache = ShmBatchCache("gone", root=tmp_path, cleanup_on_exit=False)
    x = torch.ones(2, 8, dtype=torch.int64)
    cache.put(0, 0, 1, (x, x))
    with cache:
        pass
    assert cache.path.is_dir()  # cleanup_on_exit=False keeps it for a replacement
    other = ShmBatchCache("gone", root=tmp_path)  # a second handle on the same directory
    assert other.get(0, 0, 1) is not None
    cache.cleanup()
    assert not cache.path.exists()
    assert other.get(0, 0, 1) is None
    assert not other.put(1, 0, 1, (x, x))  # does not resurrect the directory
    assert not cache.path.exists()


@pytest.mark.timeout(30)
def test_single_long_document_splits_by_tokens(tmp_path: Path, cache_dir: Path) -> None:
    root = tmp_path / "one"
    root.mkdir()
    (root / "book.txt").write_text("".join(f"sentence {i}. " for i in range(500)))
    ds = TokenDataset(root, cache_dir=cache_dir, seq_len=16, global_batch=4, val_fraction=0.1)
    assert ds.val_start == int(0.9 * len(ds.corpus))
    assert ds.num_windows("val") >= 1 and ds.num_windows("train") > ds.num_windows("val")
