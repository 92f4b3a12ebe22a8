"""Bad data is named and refused up front: damaged token caches, out-of-vocabulary ids, empty or
invalid corpora, corpora too short for one window, both from the library and from ``checkpointless run``."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from checkpointless.cli import main
from checkpointless.corpus import EOD_ID, TokenDataset, TokenizedCorpus, load_corpus
from checkpointless.recipes.config import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "llama-tiny.yaml"
ONE_STEP = ("--set", "train.steps=1", "--set", "optim.warmup_steps=0")  # should the check ever let it run


@pytest.fixture(autouse=True)
def token_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test (and every load_recipe inside it) tokenizes into its own cache."""
    cache = tmp_path / "tokens"
    monkeypatch.setenv("CHECKPOINTLESS_TOKEN_CACHE", str(cache))
    return cache


def _corpus(root: Path, n_docs: int = 30, lines: int = 20) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        (root / f"doc{i:02d}.txt").write_text("".join(f"doc {i} line {j} x={i * j}\n" for j in range(lines)))
    return root


def _recipe(tmp_path: Path, source: Path | str, **data: object) -> Path:
    raw = yaml.safe_load(TINY.read_text(encoding="utf-8"))
    raw["data"]["source"] = str(source)
    raw["data"].update(data)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def _cli_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``checkpointless run ...`` in-process; it must exit 2 with one ``error:`` line."""
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------------- token cache


@pytest.mark.timeout(30)
def test_token_cache_damaged_in_place_is_rebuilt_from_source(tmp_path: Path, token_cache: Path) -> None:
    src = _corpus(tmp_path / "corpus")
    good = load_corpus(src, cache_dir=token_cache)
    reference = np.array(good.tokens)
    token_file = good.path / "tokens.bin"
    size = token_file.stat().st_size
    with open(token_file, "r+b") as f:  # same size, every id valid: only a hash can tell
        f.write(np.full(size // 2, ord("a"), dtype=np.uint16).tobytes())
    with pytest.raises(ValueError, match=r"tokens\.bin"):
        TokenizedCorpus(good.path, from_cache=True)  # no source at hand: the file is named
    again = load_corpus(src, cache_dir=token_cache)
    assert not again.from_cache  # rebuilt from the source, same key
    assert again.key == good.key and np.array_equal(np.asarray(again.tokens), reference)
    assert [p.name for p in token_cache.iterdir() if p.is_dir()] == [good.key]

    docs = again.path / "docs.npy"
    blob = bytearray(docs.read_bytes())
    blob[-1] ^= 0x01  # one flipped bit in the document index
    docs.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=r"docs\.npy"):
        pickle.loads(pickle.dumps(again))  # unpickling reopens, and verifies
    assert not load_corpus(src, cache_dir=token_cache).from_cache


@pytest.mark.timeout(60)
def test_default_stdlib_cache_damaged_in_place_is_rebuilt(token_cache: Path) -> None:
    """The reported case: the standard-library cache filled in place with one valid byte."""
    ds = TokenDataset(seq_len=128, global_batch=16, cache_dir=token_cache)
    reference = {step: ds.batch(step, 0, 1)[0] for step in (0, 7)}
    token_file = ds.corpus.path / "tokens.bin"
    with open(token_file, "r+b") as f:
        f.write(np.full(token_file.stat().st_size // 2, ord(" "), dtype=np.uint16).tobytes())
    start = time.perf_counter()
    with pytest.raises(ValueError, match="does not match the SHA-256"):
        TokenizedCorpus(ds.corpus.path, from_cache=True)
    assert time.perf_counter() - start < 5  # ~0.07 s here: a hash of ~63 MB
    fresh = TokenDataset(seq_len=128, global_batch=16, cache_dir=token_cache)
    assert not fresh.corpus.from_cache
    for step, x in reference.items():
        assert fresh.batch(step, 0, 1)[0].equal(x)


@pytest.mark.timeout(30)
def test_out_of_vocabulary_ids_name_the_file_and_the_id(tmp_path: Path, token_cache: Path) -> None:
    corpus = load_corpus(_corpus(tmp_path / "corpus"), cache_dir=token_cache)
    entry = tmp_path / "entry"
    shutil.copytree(corpus.path, entry)
    # an entry whose recorded hash matches but whose ids the vocabulary cannot hold
    tokens = np.array(corpus.tokens)
    tokens[1234] = 300
    tokens.tofile(entry / "tokens.bin")
    meta = json.loads((entry / "meta.json").read_text())
    meta.setdefault("sha256", {})["tokens.bin"] = hashlib.sha256(tokens.tobytes()).hexdigest()
    (entry / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError) as info:
        TokenizedCorpus(entry, from_cache=True)
    msg = str(info.value)
    assert str(entry / "tokens.bin") in msg and "300" in msg and "1234" in msg and "[0, 257)" in msg
    # a vocabulary smaller than the ids stored (the end-of-document id 256 is the first too big)
    tokens[1234] = corpus.tokens[1234]
    tokens.tofile(entry / "tokens.bin")
    meta["sha256"]["tokens.bin"] = hashlib.sha256(tokens.tobytes()).hexdigest()
    meta["vocab_size"], meta["eod_id"] = 200, 0
    (entry / "meta.json").write_text(json.dumps(meta))
    first_eod = int(np.flatnonzero(tokens >= 200)[0])
    with pytest.raises(ValueError, match=rf"token id {EOD_ID} at position {first_eod} is outside"):
        TokenizedCorpus(entry, from_cache=True)


# ----------------------------------------------------------------------------- corpus checks


@pytest.mark.timeout(60)
def test_empty_directory_is_refused_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    recipe = _recipe(tmp_path, empty)
    with pytest.raises(RecipeError, match=r"data\.source") as info:
        load_recipe(recipe)
    assert str(empty) in str(info.value) and "no .txt/.md/.py/.jsonl files" in str(info.value)
    err = _cli_error(capsys, str(recipe), *ONE_STEP)
    assert str(empty) in err and "data.source" in err
    assert load_recipe(recipe, check_data=False).data.source == str(empty)  # dry runs skip the data


@pytest.mark.timeout(60)
def test_invalid_jsonl_names_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "jsonl"
    src.mkdir()
    good = [json.dumps({"text": f"record {i} " * 50}) for i in range(40)]
    (src / "a.jsonl").write_text("\n".join(good) + "\n")
    (src / "b.jsonl").write_text('{"text": "fine"}\n\n{"text": "unterminated}\n')
    recipe = _recipe(tmp_path, src)
    with pytest.raises(RecipeError, match=r"b\.jsonl:3: invalid JSON"):
        load_recipe(recipe)
    assert "b.jsonl:3" in _cli_error(capsys, str(recipe), *ONE_STEP)

    (src / "b.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')  # Latin-1, not UTF-8
    with pytest.raises(RecipeError, match=r"b\.jsonl:2: invalid UTF-8"):
        load_recipe(recipe)
    (src / "b.jsonl").write_text('{"text": "ok"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(RecipeError, match=r"b\.jsonl:2: invalid JSON"):
        load_recipe(recipe)
    (src / "b.jsonl").write_text('{"text": "lone surrogate \\ud800 is replaced"}\n')
    assert load_recipe(recipe).data.source == str(src)


@pytest.mark.timeout(60)
def test_corpus_shorter_than_a_window_names_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "short"
    src.mkdir()
    (src / "only.txt").write_text("x" * 99)  # 100 tokens with the end-of-document id
    recipe = _recipe(tmp_path, src)  # seq_len 128
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe)
    msg = str(info.value)
    assert "data.source" in msg and str(src) in msg and "too short" in msg
    assert "of its 100 tokens" in msg and "seq_len + 1 = 129" in msg
    err = _cli_error(capsys, str(recipe), *ONE_STEP)
    assert "seq_len + 1 = 129" in err
    # long enough for the train split but not for the held-out one
    _corpus(src, n_docs=20, lines=10)
    with pytest.raises(RecipeError, match=r"val split has \d+ of its \d+ tokens"):
        load_recipe(recipe, ["data.heldout_fraction=0.01"])
    assert load_recipe(recipe, ["data.seq_len=16"]).data.seq_len == 16
