"""What the job's processes say to each other, as data: every control-store key (``keys``), the
words of events, phases, roles and reasons (``vocab``) and every environment variable the launcher
passes to its processes (``env``). Imports nothing of the package: every layer may read it."""
