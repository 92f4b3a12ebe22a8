"""``python -m checkpointless``: the command line."""

from checkpointless.cli import main

raise SystemExit(main())
