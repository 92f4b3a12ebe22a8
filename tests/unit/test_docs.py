"""The documentation against the code and the results: the design's module table names every module
of the package and nothing else; the README stays short; the README and the user pages carry no
commit hashes, test names or dates; the README's one table quotes only what its JSON says; ``llms.txt``
lists every page; the README and ``llms.txt`` link only to what a clean clone holds (no page that
``make docs`` writes). The site itself is built by ``make docs``, not here."""

from __future__ import annotations

import json
import posixpath
import re
import subprocess
from pathlib import Path, PurePosixPath
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PACKAGE = REPO / "checkpointless"
README = REPO / "README.md"


def _user_pages() -> list[Path]:
    return [README, DOCS / "index.md", *sorted((DOCS / "guide").glob("*.md")),
            *sorted((DOCS / "integrations").glob("*.md"))]  # fmt: skip


def _table_modules(text: str) -> set[str]:
    """Every ``path.py`` named in the module column of the page's table."""
    names: set[str] = set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and line.lstrip().startswith("|"):
            names.update(re.findall(r"`([A-Za-z0-9_/]+\.py)`", cells[1]))
    return names


def test_module_table_names_every_module_and_nothing_else() -> None:
    listed = _table_modules((DOCS / "design" / "modules.md").read_text())
    present = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    missing, gone = sorted(present - listed), sorted(listed - present)
    assert not missing, f"modules missing from docs/design/modules.md's table: {missing}"
    assert not gone, f"docs/design/modules.md's table names modules that do not exist: {gone}"


def test_readme_is_at_most_12_kb() -> None:
    size = len(README.read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes (at most 12 KB: move the detail to docs/)"


def _commits(words: set[str]) -> set[str]:
    """The words that name a commit of this repository (all of them 40-hex words without git)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "cat-file", "--batch-check"],
                             input="".join(f"{w}^{{commit}}\n" for w in sorted(words)),
                             capture_output=True, text=True, timeout=30, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {w for w in words if len(w) == 40}
    found = {line.split()[0] for line in out.splitlines() if line.endswith(" commit") or " commit " in line}
    return {w for w in words if len(w) == 40 or any(f.startswith(w) for f in found)}


@pytest.mark.parametrize("page", _user_pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_user_pages_carry_no_commits_test_names_or_dates(page: Path) -> None:
    text = page.read_text()
    hexes = set(re.findall(r"(?<![0-9A-Za-z])[0-9a-f]{7,40}(?![0-9A-Za-z])", text))
    assert not _commits(hexes), f"{page.name} names commits: {sorted(_commits(hexes))}"
    tests = re.findall(r"\btest_[a-z0-9_]+|\btests/(?:unit|integration|slurm)\b", text)
    assert not tests, f"{page.name} names tests: {tests}"
    dates = re.findall(r"\b20\d\d-[01]\d-[0-3]\d\b", text)
    assert not dates, f"{page.name} carries dates (history goes to CHANGELOG.md): {dates}"


def _numbers(value: object) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    return []


def test_readme_table_quotes_only_what_its_json_says() -> None:
    text = README.read_text()
    section = text.split("## Compared", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past header, rule
    assert rows, "the README's comparison table is gone"
    values = _numbers(json.loads((REPO / "bench" / "results" / "compare.json").read_text()))
    for row in rows:
        for cell in row.strip("|").split("|")[1:]:  # the first column is the row's label
            for figure in re.findall(r"(?<![\d.])\d+\.\d+(?![\d.])", cell):
                places = len(figure.split(".")[1])
                assert any(round(v, places) == float(figure) for v in values), (
                    f"README's table says {figure} ({cell.strip()}): no value of bench/results/compare.json"
                )


def _links(text: str) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in t]


def _in_a_clean_clone() -> set[str]:
    """What a clean clone holds: the files git tracks (committed, or added to be) that are still
    on disk, and every folder above them. A page that ``make docs`` writes is git-ignored: not
    there."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, text=True,
                             timeout=30, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout: what a clean clone holds is unknown")
    files = {f for f in out.split("\0") if f and (REPO / f).is_file()}
    return files | {parent.as_posix() for f in files for parent in PurePosixPath(f).parents}


def _missing_from_a_clean_clone(page: Path) -> list[str]:
    """The links of ``page`` (at the repository's root) to a path a clean clone lacks."""
    present = _in_a_clean_clone()
    return [t for t in _links(page.read_text()) if posixpath.normpath(t) not in present]


def test_llms_txt_lists_every_page_and_each_exists() -> None:
    text = (REPO / "llms.txt").read_text()
    targets = set(_links(text))
    missing = _missing_from_a_clean_clone(REPO / "llms.txt")
    assert not missing, f"llms.txt links to what a clean clone lacks (written by make docs?): {missing}"
    pages = {p.relative_to(REPO).as_posix() for d in ("guide", "integrations", "design")
             for p in (DOCS / d).glob("*.md") if p.name != "index.md"}  # fmt: skip
    assert not sorted(pages - targets), f"pages missing from llms.txt: {sorted(pages - targets)}"


def test_readme_links_exist() -> None:
    missing = _missing_from_a_clean_clone(README)
    assert not missing, f"README.md links to what a clean clone lacks (written by make docs?): {missing}"


def _staleness_module() -> ModuleType:
    from bench import staleness

    return staleness


def test_a_report_is_stale_once_a_later_commit_changes_the_code_it_measures(tmp_path: Path) -> None:
    st = _staleness_module()

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    def commit(path: str, text: str) -> str:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
        git("add", path)
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", f"change {path}")
        return git("rev-parse", "HEAD")

    git("init", "-q")
    measured = commit("checkpointless/state/transfer.py", "a")
    commit("bench/transfer.py", "the harness changed")  # not the code it measures
    commit("checkpointless/recipes/x.py", "outside transfer's paths")
    assert st.staleness("transfer", {"_commit": measured}, tmp_path)["state"] == "current"
    newest = commit("checkpointless/state/transfer.py", "b")
    got = st.staleness("transfer", {"_commit": measured}, tmp_path)
    assert got["state"] == "stale" and [c[0] for c in got["commits"]] == [newest]
    assert "**Stale:** 1 commit after its commit" in st.stale_note("transfer", got)
    assert st.staleness("transfer", {"_commit": "0" * 40}, tmp_path)["state"] == "unknown"
    assert st.staleness("transfer", {}, tmp_path)["state"] == "unknown"


def test_every_benchmark_names_the_code_it_measures() -> None:
    st = _staleness_module()
    keys = {p.stem for p in (REPO / "bench" / "results").glob("*.json")} - {"machine"}
    assert not sorted(keys - set(st.MEASURES)), (
        f"bench/staleness.py's MEASURES lacks {sorted(keys - set(st.MEASURES))}"
    )
