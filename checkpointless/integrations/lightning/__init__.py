"""Lightning made checkpointless with one argument.

::

    trainer = lightning.Trainer(strategy=CheckpointlessStrategy(), max_epochs=3, ...)
    trainer.fit(model)

launched with ``checkpointless launch --workers N --spares K -- python script.py`` (or an elastic
size: ``--min-workers``, ``--max-workers``, ``--shares``). Run with plain
``python script.py`` (no launcher) it trains on one process, with no fault tolerance.

The package: ``strategy`` (``CheckpointlessStrategy``, the step), ``progress`` (Lightning's own
progress, moved to a replacement), ``data`` (the train ``DataLoader`` as a function of the step),
``collectives`` (``reduce``, ``all_gather``, ``barrier``, ``broadcast`` over the session's group).

What the strategy does (automatic optimization only):

- the step: ``optimizer_step`` runs the closure Lightning hands it (``training_step``, ``zero_grad``
  and ``backward``), the gradient reduction (``Session.reduce_gradients``), Lightning's
  ``on_before_optimizer_step`` and gradient clipping, and the optimizer update inside one
  ``session.attempt()``: a failed step (a peer killed, hung or raising) is recovered in-process
  and the same closure runs again with the same batch and the same RNG seeds before
  ``optimizer_step`` returns; the Trainer's loop never sees the failure. Session step ``s`` is
  Lightning's ``global_step`` ``s``.
- gradient accumulation (``accumulate_grad_batches=k``): the ``k`` micro-batches of one optimizer
  step are one attempt. The strategy says it handles accumulation (``handles_gradient_accumulation``,
  as DeepSpeed's does) while micro-batches remain, so Lightning hands it every micro-batch's closure;
  the attempt opens before the first one's, the gradients accumulate locally (``Session.no_sync``)
  and are reduced once, by the last micro-batch's backward and ``reduce_gradients``, before the
  update (an epoch's last step may have fewer micro-batches, as Lightning makes it). After a
  failure at any micro-batch the parameters are still those before the step (only the update
  changes them) and the session has undone the buffers' updates: the next attempt runs the
  step's closures so far again, from the first, with the same batches and the RNG reseeded at the
  step's start, and the Trainer's loop goes on with the next micro-batch. Lightning's own code
  between two micro-batches (``on_train_batch_end``, the next batch's fetch and start hooks) is not
  run again by the survivors (a replacement runs it once, like the fault-free run): collectives
  there stay each rank's own, and randomness drawn there (rather than in ``training_step``) is not
  reproduced. A ``LightningModule.optimizer_step`` of the user's own would run at every
  micro-batch (refused with accumulation), and so would validation falling inside a step
  (``val_check_interval`` not a multiple of ``k``: refused).
- shares and an elastic size (``--shares S``, ``--min-workers``, ``--max-workers``, ``checkpointless
  scale``: ``checkpointless.share_loop``): the global batch is S parts of the ``DataLoader``'s
  ``batch_size`` whatever the number of replicas, and the Trainer's epochs count S parts. Where a
  replica may compute several shares, the closure runs once per share it holds
  (``Session.shares``: the RNG reseeded for the share, BatchNorm's buffers put back, the reduction
  held until the last pass's backward), in the step's one attempt. Each pass's ``training_step``
  gets its share's batch, read by the strategy and moved to the device as Lightning moves a batch
  it fetched (the batch Lightning fetched is not used then). Only the first pass zeroes the
  gradients; the gradient is the sum over the S shares divided by S. A replica lost with no spare
  ready shrinks the job: the survivors take its shares and ``fit`` goes on (under
  ``--never-wait`` in the same step, after their own). Per share, not per step: ``training_step``
  and its ``self.log`` calls (a value logged each step is the last share's),
  ``on_before_backward``, ``on_after_backward``, the batch transfer hooks; collectives inside a
  pass are the replica's own (replicas holding different numbers of shares would not pair them).
  ``on_before_optimizer_step``, clipping and the update run once. With one share per replica and
  a fixed size nothing changes.
- the state a replacement receives: the LightningModule (parameters and buffers), the optimizer,
  every LR scheduler, the gradient scaler (fp16), the session's step and RNG states, and Lightning's
  own progress as it was when the step under way began (its loops' counters and its callbacks'
  ``state_dict``): the replacement, a hot spare waiting in ``Trainer.fit``'s setup, loads them the
  way Lightning resumes a checkpoint (``fit_loop.load_state_dict``) and enters the Trainer's loop
  at that step (its first micro-batch). The Trainer's loop itself cannot be re-entered mid-step
  from a strategy: survivors never leave ``optimizer_step`` during a recovery, and a replacement
  starts that loop afresh from the received progress (so Lightning's ``on_train_epoch_start`` hooks
  do not run for the epoch it joins, as on any mid-epoch resume). A spare that replaces a rank
  after the last step (a rank lost while the others wait in ``Session.finish``) receives the
  Trainer as ``fit`` left it on its source (the loops' counters, the callbacks' and loggers' state
  after the last epoch's end, whether it stopped early, and the metrics: ``callback_metrics``,
  ``logged_metrics``, ``progress_bar_metrics``, the source's own, not compared between replicas),
  finishes, and ``fit`` returns in it at once: the script's code after ``fit`` runs there as it
  would have in the lost process (rank 0's final save, ``trainer.test``, printed metrics).
- the data: the train ``DataLoader`` (a map-style dataset, its ``batch_size``, ``shuffle``,
  ``collate_fn``, ``num_workers``, ``drop_last``) is read through ``Session.loader`` as a function
  of the position: Lightning's batch ``b`` of epoch ``e`` is this rank's part of global batch
  ``e x batches_per_epoch + b`` of ``batch_size x ranks`` samples, an epoch's order a permutation of
  the seed and the epoch, the rank's part the ``b``-th contiguous slice. A replacement reads what
  the failed rank would have read (from the first micro-batch of its step), with no skipping;
  randomness in the dataset's ``__getitem__`` (main process) is seeded from the position and the
  rank. An ``IterableDataset`` is read the same way by ``Session.loader``'s iterable path (global
  batch ``g`` is samples ``[g x B, (g + 1) x B)`` of the one stream, in its own order); without
  ``__len__`` its batches follow one another across the Trainer's epochs.
- collectives (``reduce``, ``all_gather``, ``barrier``, ``broadcast``: ``self.log(...,
  sync_dist=True)``, ``self.all_gather``, callbacks) run over the session's group. Inside a step a
  failure there is the step's failure, recovered as any. Between steps (epoch-end aggregates,
  validation, callbacks) a failure leaves the value this rank's own until the next step, which
  recovers. A replacement's collectives before its first step are its own (its peers are inside
  that step), and so are those of Lightning's setup before the session exists: what they resolved
  that must agree (the checkpoint directory, the loggers' versions) is rank 0's once the group
  forms, as under DDP. ``broadcast`` carries a ``str``, number, bool or None (nothing received is
  unpickled); other objects stay each rank's own (they are equal on replicas). No ``env://``
  process group is started: ``torch.distributed`` stays uninitialised.
- checkpoints (``ModelCheckpoint``, ``Trainer.save_checkpoint``): rank 0 writes, every rank notes
  what it saved (its path, counters and callbacks' state). A checkpoint rank 0 died writing
  (Lightning's write is atomic: the file is whole or absent) is named by its peers' callback state;
  the replacement that takes rank 0 writes it before its first step, from the model and optimizer
  as they are (no update since the save) and the noted counters and state: the file the fault-free
  run writes; and it removes the outdated top-k file rank 0 would have removed after that save, and
  makes the ``save_last="link"`` link rank 0 would have made. A
  replacement that joins after the last step does the same for the last epoch's checkpoints (the
  saves after the last step's start join the final state, ``Progress.closing``), then finishes.
- ``fit(ckpt_path=...)`` resumes from a Lightning checkpoint (every rank reads the same file, as
  under DDP): the job starts at its step, the train data at that step's batch. A replacement takes
  its peers' state, not the file's (what Lightning would load after the session's setup is not
  loaded), and one that joins at the first step after the checkpoint enters the loop as its peers
  did.
- validation, test and predict loops run on every rank over the whole dataset (no
  ``DistributedSampler``): the replicas are equal, so are their metrics, and no failure between
  steps can make them differ. (The Hugging Face ``Trainer`` shares its evaluation's batches,
  ``integrations/hf_eval.py``, replaying outputs computed elsewhere through HF's own loop; a
  ``validation_step`` has effects of its own, ``self.log`` calls, outputs kept on the module,
  torchmetrics states, that outputs computed elsewhere cannot replay.)

Refused in one line (``ValueError``; the Trainer's settings before a spare waits, the train
dataloader when Lightning asks for it, validation inside an accumulated step when training
starts): manual optimization, ``GradientAccumulationScheduler``, a ``LightningModule.optimizer_step``
of its own with ``accumulate_grad_batches > 1``, more than one device per process or
``num_nodes > 1``, ``overfit_batches``, training with no end (``max_epochs=-1`` without ``max_steps``), a train dataloader that is not one
``DataLoader`` with a ``batch_size`` over a map-style dataset whose sampler gives an order of the
whole dataset each epoch (sequential, random, a ``DistributedSampler``, or one of the script's own:
weighted, a subset, a class of its own, read as ``checkpointless.loaders.sampler_order`` says; not one
that gives one rank's share), or over an ``IterableDataset`` (``checkpointless.loaders.iterable_loader``'s contract) read by
at most one worker process and, without ``__len__``, with ``max_steps`` (one endless epoch, or the
Trainer's epochs of ``limit_train_batches`` batches one after the other in the stream),
``all_gather(sync_grads=True)``; where a replica may compute several shares,
``accumulate_grad_batches > 1``, a ``training_step(dataloader_iter)`` and an ``optimizer_step``
closure other than Lightning's. Tested with the Lightning versions in
``pyproject.toml``'s ``lightning`` extra (``SUPPORTED``).
"""

from __future__ import annotations

import lightning
from packaging.version import Version

SUPPORTED = (Version("2.5"), Version("2.7"))
"""The Lightning versions this strategy is tested with: at least the first, below the second (the
``lightning`` extra in ``pyproject.toml`` pins the same range)."""

if not SUPPORTED[0] <= Version(lightning.__version__) < SUPPORTED[1]:
    raise ImportError(
        f"checkpointless.integrations.lightning needs lightning >={SUPPORTED[0]},<{SUPPORTED[1]} "
        f"(found {lightning.__version__}): pip install 'checkpointless[lightning]'"
    )

from checkpointless.integrations.lightning.launched import under_launcher  # noqa: E402  # after the version check
from checkpointless.integrations.lightning.strategy import CheckpointlessStrategy  # noqa: E402

__all__ = ["SUPPORTED", "CheckpointlessStrategy", "under_launcher"]
