"""``checkpointless dryrun RECIPE.yaml... [--set KEY=VALUE]...``: size training recipes without
running them (:func:`checkpointless.recipes.dryrun.dry_run`): parameters, memory per rank, what a
recovery moves. Nothing is allocated, and the recipe's data directory need not be here."""

from __future__ import annotations

import argparse

from checkpointless.cli.job_flags import Parser
from checkpointless.errors import UsageError


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="checkpointless dryrun", description="Size a training recipe without running it.")
    parser.add_argument("recipes", nargs="+", help="recipe YAML files")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key",
    )
    return parser


def run(argv: list[str]) -> int:
    """Print the dry-run table of each recipe, a blank line between them."""
    from checkpointless.recipes.config import load_recipe
    from checkpointless.recipes.dryrun import dry_run, format_dry_run

    args = build_parser().parse_args(argv)
    for i, path in enumerate(args.recipes):
        try:
            # The data directory usually lives on the training cluster, not here.
            cfg = load_recipe(path, args.overrides, check_data=False)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        if i:
            print()
        print(format_dry_run(dry_run(cfg)))
    return 0
