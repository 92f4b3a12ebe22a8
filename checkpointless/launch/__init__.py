"""Starting processes and the command line: the launcher (control store, coordinator, children),
``checkpointless`` commands, and the demo's training script. Nothing in the core imports this."""
