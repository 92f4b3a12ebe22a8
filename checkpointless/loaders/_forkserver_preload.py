"""Imported by the fork server of ``StepLoader`` as it starts (``set_forkserver_preload``): it dies
with the training process that started it (``orphans.py``). Imported nowhere else."""

from checkpointless.loaders.orphans import die_with_parent

die_with_parent()
