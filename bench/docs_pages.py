"""The benchmark pages of the documentation site, rendered from ``bench/results/*.json`` alone.

``write_pages(results_dir, out_dir)`` writes ``index.md`` (the run, the summary against the targets,
one line per report) and one page per benchmark (``KEY.md``: the command, date and commit that
measured it, its method, its tables) plus ``simulate.md``. The documentation build calls it at
every build (``docs/_ext/bench_pages.py``), so the pages cannot drift from the JSON; ``python
bench/run_all.py --render`` writes the same pages.

A report is **stale** when a commit after the one it measured changed the code it measures:
``git log <its commit>..HEAD -- MEASURES[key]``. What a benchmark measures is the package code on
its path and the scripts it runs, not its own harness (``bench/``): changing how a page is drawn
does not make a result stale. A result without a recorded commit is compared by its date instead.
``_dirty`` (the tree had uncommitted files when it ran) is shown as recorded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import common
import run_all

#: The package code a training job runs through: everything but the integrations, the recipes'
#: models and schema, the cluster-scale analysis and the plot drawn after a run.
RUNTIME = [
    "checkpointless",
    ":(exclude)checkpointless/integrations",
    ":(exclude)checkpointless/recipes",
    ":(exclude)checkpointless/analysis",
    ":(exclude)checkpointless/observe/plot.py",
]
#: The runtime with the recipes (the benchmarks that train a recipe with ``checkpointless run``).
RECIPES = [*RUNTIME[:2], *RUNTIME[3:]]

#: git pathspecs of the code each benchmark measures.
MEASURES: dict[str, list[str]] = {
    "transfer": [
        "checkpointless/state",
        "checkpointless/comm.py",
        "checkpointless/sockets.py",
        "checkpointless/control/auth.py",
    ],
    "recovery_stall": RUNTIME,
    "steady_state": RUNTIME,
    "compare": RUNTIME,
    "hang_compare": RUNTIME,
    "kill_cost": RUNTIME,
    "large_state": RUNTIME,
    "consistency": RUNTIME,
    "hsdp": RECIPES,
    "steady_compare": RUNTIME,
    "integrations": [
        "checkpointless",
        ":(exclude)checkpointless/recipes",
        ":(exclude)checkpointless/analysis",
        "tests/scripts/hf_trainer.py",
        "tests/scripts/lightning_train.py",
    ],
    "hf_eval": ["checkpointless", ":(exclude)checkpointless/recipes", ":(exclude)checkpointless/analysis"],
    "control_load": RECIPES,
    "control_scale": [
        "checkpointless/control",
        "checkpointless/launch",
        "checkpointless/observe/event_log.py",
        "checkpointless/observe/fields.py",
    ],
    "scale": ["checkpointless/analysis", "checkpointless/recipes/dryrun.py"],
    "node_stall": RUNTIME,
}


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                             timeout=60, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def staleness(key: str, res: dict[str, Any], repo: Path = common.REPO) -> dict[str, Any]:
    """Whether code ``key`` measures changed after the result was measured.

    ``{"state": "current" | "stale" | "unknown", "basis": "commit" | "date", "commits": [(sha,
    date, subject), ...] (newest first), "why": str}``.
    """
    paths = MEASURES.get(key, ["checkpointless"])
    commit, date = res.get("_commit"), res.get("_date")
    if commit:
        if _git(repo, "cat-file", "-e", f"{commit}^{{commit}}") is None:
            return {"state": "unknown", "basis": "commit", "commits": [],
                    "why": f"its commit `{str(commit)[:12]}` is not in this clone's history"}  # fmt: skip
        since, basis = [f"{commit}..HEAD"], "commit"
    elif date:
        since, basis = ["HEAD", f"--since={date}"], "date"
    else:
        return {
            "state": "unknown",
            "basis": "none",
            "commits": [],
            "why": "it recorded no commit and no date",
        }
    out = _git(repo, "log", "--format=%H%x09%cs%x09%s", *since, "--", *paths)
    if out is None:
        return {"state": "unknown", "basis": basis, "commits": [], "why": "git could not tell"}
    commits = [tuple(line.split("\t", 2)) for line in out.splitlines() if line.strip()]
    return {"state": "stale" if commits else "current", "basis": basis, "commits": commits, "why": ""}


def stale_note(key: str, st: dict[str, Any]) -> str:
    """The line under a report's provenance: current, stale (and since when), or unknown."""
    rerun = f"`OMP_NUM_THREADS=1 python bench/run_all.py --only {key}`"
    if st["state"] == "unknown":
        return f"*Whether the code it measures changed since is unknown: {st['why']}.*"
    if st["state"] == "current":
        return "*Current: no commit since changed the code it measures.*"
    n = len(st["commits"])
    sha, day, _ = st["commits"][0]
    after = "after its commit" if st["basis"] == "commit" else "after its date (no commit recorded)"
    return (
        f"**Stale:** {_plural(n, 'commit')} {after} changed the code it measures "
        f"(newest `{sha[:12]}`, {day}); rerun it with {rerun}."
    )


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


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
        state = {"current": "current", "stale": f"**stale** ({_plural(len(st['commits']), 'commit')} since)",
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
        "machine); `OMP_NUM_THREADS=1 python bench/run_all.py --only KEY` reruns one report.",
        "",
    ]
    if machine:
        index += [
            f"- **Machine:** {machine.get('nproc', '?')} CPUs, torch {machine.get('torch', '?')}, "
            f"Python {machine.get('python', '?')}, {machine.get('platform', '?')}. A shared VM: absolute "
            "times are noisy, hence medians, p95, intervals and interleaved repetitions.",
            f"- **Last run:** `OMP_NUM_THREADS=1 python bench/run_all.py {' '.join(run.get('argv', []))}`"
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
