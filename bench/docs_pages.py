"""The benchmark pages of the documentation site, rendered from ``bench/results/*.json`` alone.

``write_pages(results_dir, out_dir)`` writes ``index.md`` (the run, the summary against the targets,
one line per report) and one page per benchmark (``KEY.md``: the command, date and commit that
measured it, its method, its tables) plus ``simulate.md``. The documentation build calls it at
every build (``docs/_ext/bench_pages.py``), so the pages cannot drift from the JSON; ``python -m
bench.run_all --render`` writes the same pages.

A report is **stale** when a commit after the one it measured changed the code it measures
(``staleness.py``). ``_dirty`` (the tree had uncommitted files when it ran) is shown as recorded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from bench import common, run_all
from bench.staleness import plural, stale_note, staleness


def _measured(res: dict[str, Any]) -> str:
    return str(res.get("_date", "?"))[:10]


def _commit(res: dict[str, Any]) -> str:
    c = res.get("_commit")
    return f"`{str(c)[:12]}`" if c else "unrecorded"


def _dirty(res: dict[str, Any]) -> str:
    return {True: "yes", False: "no"}.get(res.get("_dirty"), "unrecorded")


def report_page(key: str, title: str, mod: Any, res: dict[str, Any] | None, error: str | None,
                st: dict[str, Any] | None) -> str:  # fmt: skip
    parts = [f"# {title}", "", f"`bench/{key}.py`", ""]
    if res is not None:
        parts += [run_all.provenance(res), ""]
        if st is not None:
            parts += [stale_note(key, st), ""]
    doc = (mod.__doc__ or "").split("Usage:")[0].strip()
    parts += ["<details><summary>Method</summary>", "", doc, "", "</details>", ""]
    if res is not None:
        parts += [mod.markdown(res), ""]
    else:
        parts += ["**Not measured:**", "", "```", (error or "not run").strip()[-3000:], "```", ""]
    return "\n".join(parts)


def pages(results_dir: Path = common.RESULTS, repo: Path = common.REPO) -> dict[str, str]:
    """``{file name: Markdown}`` of every benchmark page, from ``results_dir`` alone."""
    mpath = results_dir / "machine.json"
    machine = json.loads(mpath.read_text()) if mpath.is_file() else {}
    run = machine.get("run", {})
    errors = dict(run.get("errors", {}))
    results = run_all.load_results(results_dir)
    out: dict[str, str] = {}
    rows: list[list[str]] = []
    for key, title, mod in run_all.BENCHES:
        res = results.get(key)
        st = staleness(key, res, repo) if res is not None else None
        out[f"{key}.md"] = report_page(key, title, mod, res, errors.get(key), st)
        if res is None:
            rows.append([f"[{title}]({key}.md)", "not measured", "", "", ""])
            continue
        state = {"current": "current", "stale": f"**stale** ({plural(len(st['commits']), 'commit')} since)",
                 "unknown": "unknown"}[st["state"]]  # fmt: skip
        rows.append([f"[{title}]({key}.md)", _measured(res), _commit(res), _dirty(res), state])
    out["simulate.md"] = "# " + run_all.simulate_defaults().removeprefix("## ")
    index = [
        "# Benchmarks",
        "",
        "Every figure on these pages is rendered from the raw results committed in "
        "`bench/results/*.json` when the documentation is built; none is typed by hand. Each report "
        "names the command, date and commit that measured it, and is marked stale when a later commit "
        "changed the code it measures. `make bench` reruns everything (about 90 minutes on the 2-core "
        "machine), `make bench-quick` a smoke run of every benchmark (about 15); both install the `bench` "
        "extra (with torchft, a baseline). `OMP_NUM_THREADS=1 python -m bench.run_all --only KEY` reruns "
        "one report.",
        "",
    ]
    if machine:
        index += [
            f"- **Machine:** {machine.get('nproc', '?')} CPUs, torch {machine.get('torch', '?')}, "
            f"Python {machine.get('python', '?')}, {machine.get('platform', '?')}. A shared VM: absolute "
            "times are noisy, hence medians, p95, intervals and interleaved repetitions.",
            f"- **Last run:** `OMP_NUM_THREADS=1 python -m bench.run_all {' '.join(run.get('argv', []))}`"
            f" on {str(machine.get('date', '?'))[:10]}; {run_all.code_version(machine)}.",
            "- Every process runs with `OMP_NUM_THREADS=1`; collectives are gloo over loopback TCP.",
            "",
        ]
    index += [
        "## Summary against the targets",
        "",
        run_all.targets(results),
        "",
        "## Reports",
        "",
        common.md_table(["report", "measured", "commit", "dirty tree", "state"], rows),
        "",
        "```{toctree}",
        ":hidden:",
        "",
        *(key for key, _, _ in run_all.BENCHES),
        "simulate",
        "```",
        "",
    ]
    out["index.md"] = "\n".join(index)
    # no machine's absolute path in a page (older results may carry one)
    return {name: text.replace(str(common.REPO) + "/", "").replace(str(common.REPO), ".")
            for name, text in out.items()}  # fmt: skip


def write_pages(
    out_dir: Path, results_dir: Path = common.RESULTS, images_dir: Path | None = None
) -> list[Path]:
    """Write :func:`pages` into ``out_dir`` (only files whose text changed) with the plots they show
    (``image`` of a result, found in ``images_dir``: ``docs/`` where a run puts them)."""
    images_dir = images_dir or common.REPO / "docs"
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, text in pages(results_dir).items():
        path = out_dir / name
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
        written.append(path)
    for res in run_all.load_results(results_dir).values():
        image = res.get("image")
        if image and (images_dir / image).is_file():
            shutil.copyfile(images_dir / image, out_dir / image)
            written.append(out_dir / image)
    return written
