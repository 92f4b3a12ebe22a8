"""Whether a benchmark's result is stale: a commit after the one it measured changed the code it
measures (``git log <its commit>..HEAD -- MEASURES[key]``).

What a benchmark measures is the package code on its path and the scripts it runs, not its own
harness (``bench/``): changing how a page is drawn does not make a result stale. A result without a
recorded commit is compared by its date instead. Imports nothing but the standard library.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

#: The package code a training job runs through: everything but the integrations, the recipes'
#: models and schema, the cluster-scale analysis and the plot drawn after a run.
RUNTIME = [
    "checkpointless",
    ":(exclude)checkpointless/integrations",
    ":(exclude)checkpointless/recipes",
    ":(exclude)checkpointless/analysis",
    ":(exclude)checkpointless/observe/plot.py",
    ":(exclude)checkpointless/observe/run_data.py",
]
#: The runtime with the recipes (the benchmarks that train a recipe with ``checkpointless run``).
RECIPES = [*RUNTIME[:2], *RUNTIME[3:]]

#: git pathspecs of the code each benchmark measures.
MEASURES: dict[str, list[str]] = {
    "transfer": [
        "checkpointless/state",
        "checkpointless/comm.py",
        "checkpointless/group_works.py",
        "checkpointless/sockets.py",
        "checkpointless/control/auth.py",
    ],
    "recovery_stall": RUNTIME,
    "steady_state": RUNTIME,
    "share_cost": RUNTIME,
    "never_wait": RUNTIME,
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
    "startup": RUNTIME,
}


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                             timeout=60, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def staleness(key: str, res: dict[str, Any], repo: Path = REPO) -> dict[str, Any]:
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
    rerun = f"`OMP_NUM_THREADS=1 python -m bench.run_all --only {key}`"
    if st["state"] == "unknown":
        return f"*Whether the code it measures changed since is unknown: {st['why']}.*"
    if st["state"] == "current":
        return "*Current: no commit since changed the code it measures.*"
    n = len(st["commits"])
    sha, day, _ = st["commits"][0]
    after = "after its commit" if st["basis"] == "commit" else "after its date (no commit recorded)"
    return (
        f"**Stale:** {plural(n, 'commit')} {after} changed the code it measures "
        f"(newest `{sha[:12]}`, {day}); rerun it with {rerun}."
    )
