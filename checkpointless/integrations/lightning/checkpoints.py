"""The strategy's checkpoint bookkeeping: the links ``ModelCheckpoint(save_last="link")`` makes,
noted as the saves and removals are (``Progress``), and what a replacement of rank 0 finishes of
the writes, removals and links its predecessor died doing."""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.cloud_io import get_filesystem

from checkpointless.integrations.lightning import _compat as host
from checkpointless.integrations.lightning.progress import Progress

log = logging.getLogger(__name__)


def note_links(trainer: Any, progress: Progress) -> None:
    """Every ``ModelCheckpoint(save_last="link")``'s links noted before they are made (``_NotedLink``)."""
    for cb in trainer.checkpoint_callbacks:
        if getattr(cb, "save_last", None) == "link":
            host.wrap_link_checkpoint(cb, lambda link: _NotedLink(link, progress))


def complete_saves(trainer: Any, checkpoint_io: Any, progress: Progress) -> None:
    """A replacement of rank 0, before its first step: finish the checkpoint writes and removals
    its predecessor died doing since the previous step began. A checkpoint saved then and not on
    disk was being written when its writer died (Lightning's write is atomic: all of it or
    nothing), and the callbacks' state its peers sent names it: it is written now, from the
    model and optimizer as they are (those of the save: no update since) and the counters and
    callbacks' state noted at the save. An outdated one removed then and still on disk (the
    removal comes after the save that outdates it) is removed, and a ``save_last="link"`` link
    not made (or still to the previous file) is made."""
    for path, save in progress.files().items():
        there = get_filesystem(path).exists(path)
        if save is not None and "link" in save:
            target = os.path.relpath(save["link"], os.path.dirname(path))
            if not (os.path.islink(path) and os.readlink(path) == target):
                if os.path.lexists(path):
                    os.remove(path)
                os.symlink(target, path)
                log.warning("[rank 0] linked %s to %s: rank 0 died before it could", path, target)
        elif save is None and there:
            checkpoint_io.remove_checkpoint(path)
            log.warning("[rank 0] removed %s: rank 0 died before it could", path)
        elif save is not None and not there:
            checkpoint = host.dump_checkpoint(trainer, save["weights_only"])
            checkpoint.update(copy.deepcopy(save["rest"]))
            checkpoint_io.save_checkpoint(checkpoint, path)
            log.warning("[rank 0] wrote %s: rank 0 before it died writing it", path)


class _NotedLink:
    """``ModelCheckpoint._link_checkpoint`` (a static method, called with the trainer, the target
    and the link's path), the link noted first on every rank (``Progress.linked``)."""

    def __init__(self, link: Callable[..., None], progress: Progress) -> None:
        self.link, self.progress = link, progress

    def __call__(self, trainer: Any, filepath: str, linkpath: str) -> None:
        if os.path.abspath(filepath) != os.path.abspath(linkpath):  # (Lightning links nothing then)
            self.progress.linked(str(filepath), str(linkpath))
        self.link(trainer, filepath, linkpath)
