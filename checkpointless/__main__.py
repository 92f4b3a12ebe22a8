"""``python -m checkpointless``: the command line."""

from checkpointless.launch.cli import main

raise SystemExit(main())
