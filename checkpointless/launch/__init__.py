"""Starting processes: the launcher (control store, coordinator, children), the hosts of a job on
several machines, and the demo's training script. The command line (``checkpointless/cli/``)
imports this; nothing in the core does."""
