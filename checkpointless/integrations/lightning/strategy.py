"""``CheckpointlessStrategy``: where this process is, the session, the re-executable step (with
its accumulated micro-batches) and the end of the job (the package docstring says what it does)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_utilities.core.rank_zero import rank_zero_only  # Lightning's, re-exported
from torch.utils.data import DataLoader

from checkpointless.devices import local_device
from checkpointless.integrations.lightning import _compat as host
from checkpointless.integrations.lightning.checkpoints import complete_saves, note_links
from checkpointless.integrations.lightning.collectives import Collectives
from checkpointless.integrations.lightning.data import TrainBatches
from checkpointless.integrations.lightning.launched import (
    SigtermNoted,
    launched_job,
    sharing,
    startup_line,
    under_launcher,
)
from checkpointless.integrations.lightning.progress import Metrics, Progress
from checkpointless.integrations.lightning.refusals import (
    refused_loader,
    refused_settings,
    validation_inside_a_step,
)
from checkpointless.integrations.lightning.shares import SharePasses
from checkpointless.integrations.lightning.window import Window
from checkpointless.session import Session

log = logging.getLogger(__name__)


class CheckpointlessStrategy(ParallelStrategy):
    """A Lightning strategy that makes ``Trainer.fit`` fault tolerant under ``checkpointless launch``
    (``checkpointless.integrations.lightning``'s docstring). ``seed``: the base of the per-step
    RNG seeds and of the train set's shuffle (default: ``seed_everything``'s, else 0).
    ``session_kwargs``: more ``Session`` options (``broadcast_buffers``, ``overlap_reduction``,
    ``reseed_rng``)."""

    strategy_name = "checkpointless"

    def __init__(self, *, seed: int | None = None, **session_kwargs: Any) -> None:
        super().__init__()
        self.seed = seed if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", "0"))
        self._session_kwargs = session_kwargs
        self._session: Session | None = None
        self._trainer: Any = None
        self._progress = Progress()
        self._metrics = Metrics()  # the Trainer's as fit leaves them: for a replacement after the last step
        self._comm = Collectives(lambda: self._session)
        self._steps: Iterator[int] | None = None
        self._total = -1  # the job's steps (the Trainer's estimated_stepping_batches)
        self._start = 0  # the step the job starts at: a checkpoint's that fit(ckpt_path=...) resumes from
        self._window: Window | None = None  # the step under way, from its first micro-batch
        self._batches: TrainBatches | None = None
        self._finished = False
        self._joining = False  # a replacement, before its first step: its loop counters are aligned then
        self._sharing = False  # a replica may compute several shares: every step runs the share loop
        self._passes = SharePasses(self._comm)  # the share whose pass runs (with ``_sharing``)
        self.digest: str | None = None
        """The final state's SHA-256 (``Session.finish``), once ``fit`` has ended."""

    @property
    def session(self) -> Session | None:
        """The ``checkpointless.Session`` of the ``fit`` under way (None before its setup)."""
        return self._session

    def _require_session(self) -> Session:
        assert self._session is not None, "the session is made in setup()"
        return self._session

    # -- where this process is ---------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        if under_launcher():
            return self._session.device if self._session is not None else local_device()
        return self.parallel_devices[0] if self.parallel_devices else torch.device("cpu")

    @property
    def global_rank(self) -> int:
        return self._session.rank if self._session is not None else 0

    @property
    def local_rank(self) -> int:
        return 0  # one device per process (root_device)

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return self._session.world_size if self._session is not None else 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}  # no DistributedSampler: see the package docstring

    @property
    def handles_gradient_accumulation(self) -> bool:
        """True while an accumulated step has micro-batches to come: Lightning then hands every
        micro-batch's closure to ``optimizer_step`` (as it does for DeepSpeed) instead of running
        it itself, so that the step's micro-batches run in its one attempt. False at an epoch's
        last batch, where Lightning ends a shorter step as it does by itself."""
        trainer = self._trainer
        if trainer is None or trainer.accumulate_grad_batches == 1:
            return False
        return not host.ready_batches_reached(trainer)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def teardown(self) -> None:
        if self._batches is not None:
            self._batches.close()
        super(ParallelStrategy, self).teardown()  # the cluster environment is the launcher's

    # -- setup: refusals, the session ----------------------------------------------------------
    def _refuse(self, what: list[str]) -> None:
        if what:
            raise ValueError("CheckpointlessStrategy does not support " + "; ".join(what))

    def setup(self, trainer: Any) -> None:
        self._trainer = trainer
        if trainer.state.fn == TrainerFn.FITTING:
            self._refuse(
                refused_settings(self, trainer, launched=under_launcher(), sharing=sharing(launched_job()))
            )
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return  # validate, test, predict: this process alone (see the package docstring)
        state: dict[str, Any] = {
            f"lr_scheduler{i}": c.scheduler for i, c in enumerate(self.lr_scheduler_configs)
        }
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            state["grad_scaler"] = scaler
        state["lightning"] = self._progress
        state["lightning_metrics"] = self._metrics
        note_links(trainer, self._progress)  # save_last="link"'s links, noted as the saves are
        if self._progress.callback not in trainer.callbacks:
            trainer.callbacks.append(self._progress.callback)
        assert self.lightning_module is not None
        # a spare waits here for a rank, then receives the state (``_join``)
        self._session = Session(
            self.lightning_module, self.optimizers[0], state=state, seed=self.seed, **self._session_kwargs
        )
        self._sharing = sharing(self._session.job)
        # Lightning's rank-zero-only output: set at import from LOCAL_RANK (the slot), now the rank
        rank_zero_only.rank = self._session.rank  # type: ignore[attr-defined]
        # next to Lightning's own startup lines (its rank-zero output), what they get wrong here
        rank_zero_info(startup_line(self._session))
        # Before each batch Lightning broadcasts a SIGTERM flag over the default group, which the
        # session's generation is: outside the step, where a replacement entering the loop would
        # pair it with its peers' next collective. The launcher stops a job itself (Ctrl-C, SIGTERM).
        # Its SIGTERM handler (registered after this) broadcasts too, from wherever the signal
        # lands: it notes the signal only (Lightning then stops at the next batch).
        host.mute_sigterm_broadcast(trainer, SigtermNoted)
        if self._progress.received and self._progress.snapshot["step"] >= 0:
            self._join(trainer)
            return
        # No rank has begun a step: every rank of the generation is here, and collectives are
        # real from now on. What Lightning broadcast before the group existed was each rank's own:
        # the checkpoint directory and the loggers' versions (from each rank's look at the log
        # directory) are rank 0's, as under DDP.
        self._comm.align()
        for cb in trainer.checkpoint_callbacks:
            if isinstance(getattr(cb, "dirpath", None), str):
                cb.dirpath = self.broadcast(cb.dirpath)
        for logger in trainer.loggers:
            host.set_logger_version(logger, self.broadcast(host.logger_version(logger)))

    def _join(self, trainer: Any) -> None:
        """A replacement: enter the Trainer's loop where the state it received was taken."""
        session = self._require_session()
        snapshot_step = int(self._progress.snapshot["step"])
        # Started with fit(ckpt_path=...), the Trainer would now load the checkpoint's optimizer,
        # schedulers, scaler and loop counters over the state just received: it loaded the model
        # and the callbacks (before setup), the state received replaced them, and nothing is left
        # to load.
        host.forget_loaded_checkpoint(trainer)
        if session.step != snapshot_step:
            # the job had done its last step (a rank died in Session.finish): nothing left to train.
            # The Trainer as fit left it on the source: fit returns at once, and the script's code
            # after it runs here as it would have in the lost process.
            log.info(
                "[rank %d] joined after the last step %d: finishing", session.rank, session.committed_step
            )
            self._complete_saves()  # the last epoch's checkpoint, if rank 0 died writing it
            self._progress.finished(trainer)
            self._metrics.restore(trainer)
            self._finish(total=session.step, closing=False)
            return
        self._progress.restore(trainer)
        # Lightning may have made the train iterator already, at step 0: ``estimated_stepping_batches``
        # in ``configure_optimizers`` loads the train data (and prefetches a batch) before this
        # process had a rank. Made again at fit's start, it starts at the step received.
        host.drop_train_iterator(trainer)
        self._joining = True
        log.info("[rank %d] joined at step %d (epoch %d)", session.rank, session.step, trainer.current_epoch)

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's (its arguments differ between the versions covered), keeping the step to
        start at and the fit loop's state for a replacement that joins at the first step after the
        checkpoint (``Progress.resumed``)."""
        checkpoint: dict[str, Any] = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._start = int(checkpoint.get("global_step", 0))
        self._progress.resumed(checkpoint.get("loops", {}).get("fit_loop"))
        return checkpoint

    def process_dataloader(self, dataloader: object) -> object:
        """The train loader, read as a function of the step (``TrainBatches``); others as they are.
        Lightning may ask for the train loader before the session exists (``estimated_stepping_batches``
        in ``configure_optimizers``, stage not set yet) and keep what it got for the whole ``fit``: it
        is wrapped then too, its length that of the job's shares (``--shares``, by default its workers),
        as a ``DistributedSampler`` gives DDP."""
        trainer = self._trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return dataloader
        if trainer.state.stage not in (None, RunningStage.TRAINING):
            return dataloader  # validation (or its sanity check) during fit
        if self._session is not None:
            ranks = self._session.dp_size
        else:
            job = launched_job()
            ranks = job.share_count if job is not None else 1
        refused = refused_loader(dataloader, ranks, trainer.max_steps)
        self._refuse([refused] if refused else [])
        assert isinstance(dataloader, DataLoader)
        if self._batches is not None:
            self._batches.close()
        self._batches = TrainBatches(self, trainer, dataloader, ranks)
        return self._batches

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning's (rank 0 writes), noted on every rank first (``Progress.saved``)."""
        self._progress.saved(checkpoint, str(filepath))
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning's (rank 0 removes), noted on every rank first (``Progress.removed``)."""
        self._progress.removed(str(filepath))
        super().remove_checkpoint(filepath)

    def _complete_saves(self) -> None:
        """A replacement of rank 0, before its first step (``checkpoints.complete_saves``)."""
        if self.global_rank == 0:
            complete_saves(self._trainer, self.checkpoint_io, self._progress)

    def on_train_start(self) -> None:
        refused = validation_inside_a_step(self._trainer)
        self._refuse([refused] if refused else [])

    # -- the step ------------------------------------------------------------------------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._window is not None:
            return  # a later micro-batch of the step under way
        if self._joining:
            self._joining = False
            self._complete_saves()
            self._progress.align(self._trainer)
        self._progress.capture(self._trainer)

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """One micro-batch's closure (``training_step``, ``zero_grad`` at the step's first,
        ``backward``), its gradients accumulated locally; at the step's last micro-batch (every
        batch without accumulation) the gradient reduction, Lightning's ``on_before_optimizer_step``
        and clipping, and the update. The step's micro-batches are one session attempt: after a
        recovery its closures so far run again, from the first, before this returns. Where a
        replica may compute several shares (no accumulation then) the closure runs once per share
        this replica holds (``SharePasses.run``)."""
        session = self._require_session()
        trainer = self._trainer
        model = model or self.lightning_module
        if self._steps is None:
            self._total = int(trainer.estimated_stepping_batches)
            # a fit(ckpt_path=...) starts at the checkpoint's step, on every rank (a replacement
            # passes it too, and holds its own later position)
            self._steps = session.steps(self._total, start=self._start)
        last = not host.should_accumulate(trainer)  # Lightning's own test
        if self._sharing and not host.zero_grad_inside(closure):
            self._refuse([f"several shares a replica with an optimizer_step closure of type {type(closure).__name__} "
                          "(hand Lightning's closure to optimizer.step)"])  # fmt: skip
        # a failed attempt's first closure ran zero_grad: its count stays what one attempt makes it
        zero_grad = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.zero_grad
        if self._window is None:
            self._window = Window(zero_grad.state_dict())
        window = self._window
        window.closures.append(closure)

        def closure_and_reduction() -> Any:
            loss = self._passes.run(session, closure) if self._sharing else closure()
            session.reduce_gradients()
            return loss  # then Lightning's on_before_optimizer_step and clipping, then the update

        while True:
            again = [] if window.open else window.closures[:-1]  # after a recovery: the step's earlier ones
            if not window.open:
                self._begin(window)
            self._comm.enter_step()
            try:
                for earlier in again:
                    with session.no_sync():
                        earlier()
                if not last:
                    with session.no_sync():  # reduced once, by the last micro-batch's
                        closure()
                    return None
                result = self.precision_plugin.optimizer_step(
                    optimizer, model=model, closure=closure_and_reduction, **kwargs
                )
            except BaseException as e:
                if not window.fail(e):
                    raise
                zero_grad.load_state_dict(window.zero_grad)  # recovered: the same step again
                continue
            finally:
                self._comm.leave_step()
            window.commit()
            self._window = None
            self._comm.close_window()
            return result

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's, given the batch of the share whose pass runs where a replica may compute
        several shares: that share's part of the step's global batch (read by ``TrainBatches``),
        transferred as the training loop transfers a batch it fetched (``convert_input``,
        ``on_before_batch_transfer``, ``batch_to_device``: those hooks run at every pass). The
        batch Lightning fetched (this rank's part when it was fetched) is not used then."""
        if self._passes.current is not None and args:
            assert self._batches is not None, "the train loader is wrapped when Lightning asks for it"
            batch = self._batches.share_batch(self._trainer.global_step, self._passes.current)
            batch = self.precision_plugin.convert_input(batch)
            batch = host.before_batch_transfer(self.lightning_module, batch)
            args = (self.batch_to_device(batch, dataloader_idx=0), *args[1:])
        return super().training_step(*args, **kwargs)

    def _begin(self, window: Window) -> None:
        """The next attempt of the step under way (the replicas' consistency check runs first when due)."""
        assert self._steps is not None
        try:
            step = next(self._steps)
        except StopIteration:
            raise RuntimeError(
                f"the Trainer runs step {self._trainer.global_step} beyond the job's total"
            ) from None
        assert step == self._trainer.global_step, (step, self._trainer.global_step)
        self._comm.open_window()
        window.enter(self._require_session())

    def on_train_end(self) -> None:
        self._finish(total=self._trainer.global_step)

    def _finish(self, total: int, closing: bool = True) -> None:
        """After the last step: the replicas' last check, then ``Session.finish`` (which serves as a
        recovery source until every rank is done). A Trainer that stopped before the job's total
        (``EarlyStopping``: every rank decides alike) ends the job at its ``global_step``.
        ``closing``: the Trainer's final state joins the state (a replacement received it)."""
        session = self._session
        if session is None or self._finished:
            return
        self._finished = True
        if closing:  # the saves after the last step's start and the Trainer as fit leaves it
            self._progress.closing(self._trainer)
            self._metrics.capture(self._trainer)
        steps = self._steps if self._steps is not None and total == self._total else session.steps(total)
        for step in steps:
            raise RuntimeError(f"the Trainer ended before step {step}")
        self.digest = session.finish()

    # -- collectives (collectives.py says when they run over the group) ------------------------
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``sum``, ``mean``, ``max`` or ``min`` over the ranks (``group`` is ignored: one group)."""
        return self._comm.reduce(tensor, reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor``, stacked in rank order (``(world_size, *shape)``)."""
        if sync_grads:
            raise ValueError("CheckpointlessStrategy does not support all_gather(sync_grads=True)")
        return self._comm.all_gather(tensor)

    def barrier(self, name: str | None = None) -> None:
        self._comm.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``src``'s ``obj`` if it is a ``str``, number, bool or None; any other object stays this
        rank's own (nothing received is unpickled; Lightning broadcasts paths and decisions)."""
        return self._comm.broadcast(obj, src)
