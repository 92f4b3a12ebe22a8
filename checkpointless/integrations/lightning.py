"""Lightning made checkpointless with one argument.

::

    trainer = lightning.Trainer(strategy=CheckpointlessStrategy(), max_epochs=3, ...)
    trainer.fit(model)

launched with ``checkpointless launch --workers N --spares K -- python script.py``. Run with plain
``python script.py`` (no launcher) it trains on one process, with no fault tolerance.

What the strategy does (automatic optimization only):

- the step: ``optimizer_step`` runs the closure Lightning hands it (``training_step``, ``zero_grad``
  and ``backward``), the gradient reduction (``Session.reduce_gradients``), Lightning's
  ``on_before_optimizer_step`` and gradient clipping, and the optimizer update inside one
  ``session.attempt()``: a failed step (a peer killed, hung or raising) is recovered in-process
  and the same closure runs again with the same batch and the same RNG seeds before
  ``optimizer_step`` returns; the Trainer's loop never sees the failure. Session step ``s`` is
  Lightning's ``global_step`` ``s``.
- the state a replacement receives: the LightningModule (parameters and buffers), the optimizer,
  every LR scheduler, the gradient scaler (fp16), the session's step and RNG states, and Lightning's
  own progress as it was when the step under way began (its loops' counters and its callbacks'
  ``state_dict``): the replacement, a hot spare waiting in ``Trainer.fit``'s setup, loads them the
  way Lightning resumes a checkpoint (``fit_loop.load_state_dict``) and enters the Trainer's loop
  at that step. The Trainer's loop itself cannot be re-entered mid-step from a strategy: survivors
  never leave ``optimizer_step`` during a recovery, and a replacement starts that loop afresh from
  the received progress (so Lightning's ``on_train_epoch_start`` hooks do not run for the epoch it
  joins, as on any mid-epoch resume). A spare that replaces a rank after the last step (a rank lost
  while the others wait in ``Session.finish``) only finishes and exits 0 from ``fit``'s setup.
- the data: the train ``DataLoader`` (a map-style dataset, its ``batch_size``, ``shuffle``,
  ``collate_fn``, ``num_workers``, ``drop_last``) is read through ``Session.loader`` as a function
  of the step: Lightning's batch ``b`` of epoch ``e`` is this rank's part of global batch
  ``e x batches_per_epoch + b`` of ``batch_size x ranks`` samples, an epoch's order a permutation of
  the seed and the epoch, the rank's part the ``b``-th contiguous slice. A replacement reads what
  the failed rank would have read, with no skipping; randomness in the dataset's ``__getitem__``
  (main process) is seeded from the step and the rank.
- collectives (``reduce``, ``all_gather``, ``barrier``, ``broadcast``: ``self.log(...,
  sync_dist=True)``, ``self.all_gather``, callbacks) run over the session's group. Inside a step a
  failure there is the step's failure, recovered as any. Between steps (epoch-end aggregates,
  validation, callbacks) a failure leaves the value this rank's own until the next step, which
  recovers. A replacement's collectives before its first step are its own (its peers are inside
  that step), and so are those of Lightning's setup before the session exists: what they resolved
  that must agree (the checkpoint directory, the loggers' versions) is rank 0's once the group
  forms, as under DDP. ``broadcast`` carries a ``str``,
  number, bool or None (nothing received is unpickled); other objects stay each rank's own (they
  are equal on replicas). No ``env://`` process group is started: ``torch.distributed`` stays
  uninitialised.
- validation, test and predict loops run on every rank over the whole dataset (no
  ``DistributedSampler``): the replicas are equal, so are their metrics.

Refused in one line (``ValueError``; the Trainer's settings before a spare waits, the train
dataloader when Lightning asks for it): manual optimization,
``accumulate_grad_batches > 1``, more than one device per process or ``num_nodes > 1``,
``overfit_batches``, resuming from a Lightning checkpoint (``ckpt_path``), training with no end
(``max_epochs=-1`` without ``max_steps``), a train dataloader that is not one ``DataLoader`` over a
map-style dataset with a ``batch_size`` and a plain sequential or random sampler,
``all_gather(sync_grads=True)``. Tested with the Lightning versions in ``pyproject.toml``'s
``lightning`` extra (``SUPPORTED``).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import lightning
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning_utilities.core.rank_zero import rank_zero_only  # Lightning's, re-exported
from packaging.version import Version
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from checkpointless.control.env import ENV_STORE
from checkpointless.devices import local_device
from checkpointless.errors import CollectiveError
from checkpointless.session import Session, step_seed

log = logging.getLogger(__name__)

SUPPORTED = (Version("2.5"), Version("2.7"))
"""The Lightning versions this strategy is tested with: at least the first, below the second (the
``lightning`` extra in ``pyproject.toml`` pins the same range)."""

if not SUPPORTED[0] <= Version(lightning.__version__) < SUPPORTED[1]:
    raise ImportError(
        f"checkpointless.integrations.lightning needs lightning >={SUPPORTED[0]},<{SUPPORTED[1]} "
        f"(found {lightning.__version__}): pip install 'checkpointless[lightning]'"
    )


def under_launcher() -> bool:
    """Whether this process was started by ``checkpointless launch`` (or ``run``, ``cluster``)."""
    return ENV_STORE in os.environ


class _Progress:
    """Lightning's own progress at the start of the step under way, registered with the session as
    ``lightning``: the fit loop's ``state_dict`` (its counters) as a checkpoint saved at the previous
    batch's ``on_train_batch_end`` holds it (Lightning's own mid-epoch resume), and each callback's
    ``state_dict`` (by ``state_key``) at this step's start, after the previous step's validation
    and epoch end. Equal on every replica (the replicas compare it with the rest of the state). It
    adds a callback to the Trainer (the last one) to see ``on_train_batch_end``."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {"step": -1}
        self.received = False  # loaded from a peer: this process is a replacement
        self._loops: dict[str, Any] | None = None  # at the last on_train_batch_end

        self.callback = _BatchEnd(self)

    def capture(self, trainer: Any) -> None:
        """At the start of step ``trainer.global_step`` (the strategy's ``on_train_batch_start``)."""
        callbacks = {}
        for cb in trainer.callbacks:
            state = cb.state_dict()
            if state:
                callbacks[cb.state_key] = copy.deepcopy(state)
        self.snapshot = {
            "step": trainer.global_step,
            "loops": self._loops,
            "at_start": copy.deepcopy(trainer.fit_loop.state_dict()),
            "callbacks": callbacks,
            "loggers": [_logger_version(logger) for logger in trainer.loggers],
        }

    def restore(self, trainer: Any) -> None:
        """Put the Trainer where the snapshot was taken, as Lightning resumes from a checkpoint saved
        at the previous batch's end (``align`` finishes it at the step's start)."""
        self._loops = self.snapshot["loops"]  # this step's snapshot holds it again, as its source's
        if self._loops is not None:  # None: the first step, nothing to resume
            trainer.fit_loop.load_state_dict(copy.deepcopy(self._loops))
        callbacks = self.snapshot["callbacks"]
        for cb in trainer.callbacks:
            if cb.state_key in callbacks:
                state = copy.deepcopy(callbacks[cb.state_key])
                if isinstance(state.get("dirpath"), str) and hasattr(cb, "dirpath"):
                    cb.dirpath = state["dirpath"]  # ModelCheckpoint's: its rank 0's, not resolved anew
                cb.load_state_dict(state)
        for logger, version in zip(trainer.loggers, self.snapshot["loggers"], strict=False):
            _set_logger_version(logger, version)  # rank 0 logs on in the same directory

    def align(self, trainer: Any) -> None:
        """At a replacement's first ``on_train_batch_start``: every counter of the Trainer's loops
        as its source's at that point. Lightning's resume leaves some off by one (the epoch's
        ``ready``/``started`` after a resume at an epoch's last batch, the batch's ``ready``); they
        count, they do not steer this step, and the replicas compare them."""
        for key, value in copy.deepcopy(self.snapshot["at_start"]).items():
            *path, name = key.split(".")
            loop = trainer.fit_loop
            for attr in path:
                loop = getattr(loop, attr)
            if name != "state_dict":
                getattr(loop, name).load_state_dict(value)
            elif loop is not trainer.fit_loop:  # the fit loop's own is its loaders' state: none here
                loop.on_load_checkpoint(value)

    def state_dict(self) -> dict[str, Any]:
        return self.snapshot

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.snapshot = state
        self.received = True


def _logger_version(logger: Any) -> Any:
    """A logger's version (the directory it writes to) if it has one to set (CSV, TensorBoard)."""
    return logger.version if hasattr(logger, "_version") and isinstance(logger.version, int | str) else None


def _set_logger_version(logger: Any, version: Any) -> None:
    if version is not None and hasattr(logger, "_version"):
        logger._version = version


class _BatchEnd(Callback):
    """Keeps the fit loop's state at each ``on_train_batch_end`` for ``_Progress`` (no state of its own)."""

    def __init__(self, progress: _Progress) -> None:
        self._progress = progress

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self._progress._loops = copy.deepcopy(trainer.fit_loop.state_dict())


class _TrainBatches:
    """The train ``DataLoader`` as the Trainer iterates it: an epoch's batches from the one the
    Trainer is at, each read by the session's ``StepLoader`` as a function of its position."""

    def __init__(self, strategy: CheckpointlessStrategy, dataloader: DataLoader[Any]) -> None:
        session = strategy._require_session()
        per_rank = dataloader.batch_size
        assert per_rank is not None  # checked by _refused_loader
        self._strategy = strategy
        self.dataset = dataloader.dataset
        self._loader = session.loader(
            dataloader.dataset, per_rank * session.dp_size, shuffle=isinstance(dataloader.sampler, RandomSampler),
            seed=strategy.seed, collate_fn=dataloader.collate_fn, num_workers=dataloader.num_workers,
            drop_last=dataloader.drop_last, pin_memory=dataloader.pin_memory,
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        trainer = self._strategy._trainer
        assert trainer is not None
        per_epoch = len(self._loader)  # the data's epoch; the Trainer's may be shorter (limit_train_batches)
        epoch, first = divmod(trainer.global_step, self._strategy._trainer_epoch(per_epoch))
        return self._batches(epoch * per_epoch, first, per_epoch)

    def _batches(self, base: int, first: int, per_epoch: int) -> Iterator[Any]:
        seed, rank = self._strategy.seed, self._strategy.global_rank
        for b in range(first, per_epoch):
            step = base + b
            # the dataset's own randomness (augmentation in the main process) is a function of the
            # step, not of when the Trainer prefetches it; the training RNG is left untouched
            with torch.random.fork_rng(devices=[]):
                state = np.random.get_state(), random.getstate()
                s = step_seed(seed ^ 0x5EED, step, rank)
                torch.manual_seed(s)
                np.random.seed(s % 2**32)
                random.seed(s)
                try:
                    batch = self._loader.batch(step)
                finally:
                    np.random.set_state(state[0])
                    random.setstate(state[1])
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Nothing: the position is the Trainer's step (this makes Lightning see a resumable loader)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        self._loader.close()


def _refused_loader(dataloader: object) -> str | None:
    if not isinstance(dataloader, DataLoader):
        return f"a train dataloader of type {type(dataloader).__name__} (give one torch DataLoader)"
    if isinstance(dataloader.dataset, IterableDataset):
        return "an IterableDataset as the train set (give a map-style dataset)"
    if dataloader.batch_size is None:
        return "a train DataLoader without batch_size (a batch_sampler of its own)"
    if type(dataloader.sampler) not in (RandomSampler, SequentialSampler):
        return f"a train DataLoader with a sampler of its own ({type(dataloader.sampler).__name__})"
    return None


def _op(reduce_op: Any) -> str:
    """``sum``, ``mean``, ``max`` or ``min`` from Lightning's ``reduce_op`` (a string or a ``ReduceOp``)."""
    if reduce_op is None:
        return "mean"
    name = str(reduce_op).lower().rsplit(".", 1)[-1]
    name = {"avg": "mean", "average": "mean"}.get(name, name)
    if name not in ("sum", "mean", "max", "min"):
        raise ValueError(f"CheckpointlessStrategy.reduce does not support reduce_op={reduce_op!r}")
    return name


class CheckpointlessStrategy(ParallelStrategy):
    """A Lightning strategy that makes ``Trainer.fit`` fault tolerant under ``checkpointless launch``
    (module docstring). ``seed``: the base of the per-step RNG seeds and of the train set's
    shuffle (default: ``seed_everything``'s, else 0). ``session_kwargs``: more ``Session`` options
    (``broadcast_buffers``, ``overlap_reduction``, ``reseed_rng``)."""

    strategy_name = "checkpointless"

    def __init__(self, *, seed: int | None = None, **session_kwargs: Any) -> None:
        super().__init__()
        self.seed = seed if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", "0"))
        self._session_kwargs = session_kwargs
        self._session: Session | None = None
        self._trainer: Any = None
        self._progress = _Progress()
        self._steps: Iterator[int] | None = None
        self._total = -1  # the job's steps (the Trainer's estimated_stepping_batches)
        self._in_step = False  # inside a session attempt: a failed collective is the step's failure
        self._aligned = False  # every rank at the same point between steps: collectives are real
        self._batches: _TrainBatches | None = None
        self._finished = False
        self._joining = False  # a replacement, before its first step: its loop counters are aligned then
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
        return {"num_replicas": 1, "rank": 0}  # no DistributedSampler: see the module docstring

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def teardown(self) -> None:
        if self._batches is not None:
            self._batches.close()
        super(ParallelStrategy, self).teardown()  # the cluster environment is the launcher's

    # -- setup: refusals, the session ----------------------------------------------------------
    def _refusals(self, trainer: Any) -> list[str]:
        out = []
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            out.append("manual optimization (LightningModule.automatic_optimization = False)")
        if trainer.accumulate_grad_batches > 1:
            out.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches}")
        if len(self.parallel_devices or []) > 1 or trainer.num_nodes > 1:
            out.append(
                f"devices={len(self.parallel_devices or [])}, num_nodes={trainer.num_nodes} (one device "
                "per process: the processes are checkpointless launch's --workers)"
            )
        if trainer.overfit_batches > 0:
            out.append("overfit_batches")
        if trainer.ckpt_path is not None:
            out.append("resuming from a Lightning checkpoint (ckpt_path)")
        if trainer.max_steps == -1 and trainer.max_epochs in (None, -1):
            out.append("training without an end (max_epochs=-1 and no max_steps)")
        accelerator = type(trainer.accelerator).__name__
        device = self.root_device.type
        if (
            under_launcher()
            and {"cpu": "CPUAccelerator", "cuda": "CUDAAccelerator"}.get(device) != accelerator
        ):
            out.append(
                f"accelerator {accelerator} when the job trains on {device} (launch's --backend, --device)"
            )
        return out

    def _refuse(self, what: list[str]) -> None:
        if what:
            raise ValueError("CheckpointlessStrategy does not support " + "; ".join(what))

    def setup(self, trainer: Any) -> None:
        self._trainer = trainer
        if trainer.state.fn == TrainerFn.FITTING:
            self._refuse(self._refusals(trainer))
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return  # validate, test, predict: this process alone (see the module docstring)
        state: dict[str, Any] = {
            f"lr_scheduler{i}": c.scheduler for i, c in enumerate(self.lr_scheduler_configs)
        }
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            state["grad_scaler"] = scaler
        state["lightning"] = self._progress
        if self._progress.callback not in trainer.callbacks:
            trainer.callbacks.append(self._progress.callback)
        assert self.lightning_module is not None
        # a spare waits here for a rank, then receives the state (``_join``)
        self._session = Session(
            self.lightning_module, self.optimizers[0], state=state, seed=self.seed, **self._session_kwargs
        )
        # Lightning's rank-zero-only output: set at import from LOCAL_RANK (the slot), now the rank
        rank_zero_only.rank = self._session.rank  # type: ignore[attr-defined]
        if self._progress.received and self._progress.snapshot["step"] >= 0:
            self._join(trainer)
            return
        # No rank has begun a step: every rank of the generation is here, and collectives are
        # real from now on. What Lightning broadcast before the group existed was each rank's own:
        # the checkpoint directory and the loggers' versions (from each rank's look at the log
        # directory) are rank 0's, as under DDP.
        self._aligned = True
        for cb in trainer.checkpoint_callbacks:
            if isinstance(getattr(cb, "dirpath", None), str):
                cb.dirpath = self.broadcast(cb.dirpath)
        for logger in trainer.loggers:
            _set_logger_version(logger, self.broadcast(_logger_version(logger)))

    def _join(self, trainer: Any) -> None:
        """A replacement: enter the Trainer's loop where the state it received was taken."""
        session = self._require_session()
        snapshot_step = int(self._progress.snapshot["step"])
        if session.step != snapshot_step:
            # the job had done its last step (a rank died in Session.finish): nothing left to train
            log.info(
                "[rank %d] joined after the last step %d: finishing", session.rank, session.committed_step
            )
            self._finish(total=session.step)
            raise SystemExit(0)
        self._progress.restore(trainer)
        self._joining = True
        log.info("[rank %d] joined at step %d (epoch %d)", session.rank, session.step, trainer.current_epoch)

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self._trainer
        if self._session is None or trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        refused = _refused_loader(dataloader)
        if refused is None:
            assert isinstance(dataloader, DataLoader)
            n, world = len(dataloader.dataset), self.world_size  # type: ignore[arg-type]
            tail = n % ((dataloader.batch_size or 1) * world)
            if not dataloader.drop_last and tail % world:
                refused = (
                    f"drop_last=False with a last global batch of {tail} samples, which {world} ranks "
                    "cannot share evenly (set drop_last=True)"
                )
        self._refuse([refused] if refused else [])
        assert isinstance(dataloader, DataLoader)
        if self._batches is not None:
            self._batches.close()
        self._batches = _TrainBatches(self, dataloader)
        return self._batches

    def _trainer_epoch(self, per_epoch: int) -> int:
        """Batches in one of the Trainer's epochs over ``per_epoch`` batches of data (``limit_train_batches``)."""
        limit = self._trainer.limit_train_batches
        batches = min(per_epoch, limit) if isinstance(limit, int) else int(per_epoch * limit)
        return max(1, batches)

    # -- the step ------------------------------------------------------------------------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._joining:
            self._joining = False
            self._progress.align(self._trainer)
        self._progress.capture(self._trainer)

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """One optimizer step as one re-executable block (module docstring)."""
        session = self._require_session()
        trainer = self._trainer
        model = model or self.lightning_module
        if self._steps is None:
            self._total = int(trainer.estimated_stepping_batches)
            self._steps = session.steps(self._total)

        def closure_and_reduction() -> Any:
            loss = closure()  # training_step, zero_grad, backward
            session.reduce_gradients()
            return loss  # then Lightning's on_before_optimizer_step and clipping, then the update

        # a failed attempt's closure ran zero_grad: its count stays what one attempt makes it
        zero_grad = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.zero_grad
        counted = zero_grad.state_dict()
        while True:
            try:
                step = next(self._steps)  # the replicas' consistency check runs here when due
            except StopIteration:
                raise RuntimeError(
                    f"the Trainer runs step {trainer.global_step} beyond the job's total"
                ) from None
            assert step == trainer.global_step, (step, trainer.global_step)
            self._in_step = self._aligned = True
            try:
                with session.attempt() as attempt:
                    result = self.precision_plugin.optimizer_step(
                        optimizer, model=model, closure=closure_and_reduction, **kwargs
                    )
            finally:
                self._in_step = False
            if attempt.committed:
                return result
            zero_grad.load_state_dict(counted)  # recovered: the same step again, with the same batch

    def on_train_end(self) -> None:
        self._finish(total=self._trainer.global_step)

    def _finish(self, total: int) -> None:
        """After the last step: the replicas' last check, then ``Session.finish`` (which serves as a
        recovery source until every rank is done). A Trainer that stopped before the job's total
        (``EarlyStopping``: every rank decides alike) ends the job at its ``global_step``."""
        session = self._session
        if session is None or self._finished:
            return
        self._finished = True
        steps = self._steps if self._steps is not None and total == self._total else session.steps(total)
        for step in steps:
            raise RuntimeError(f"the Trainer ended before step {step}")
        self.digest = session.finish()

    # -- collectives ---------------------------------------------------------------------------
    def _group(self, tensor: torch.Tensor | None = None) -> Any:
        """The session's group for ``tensor`` (its control group for CPU tensors), or None when this
        rank's collectives are its own (one process; before the first step; after a failure
        between steps)."""
        session = self._session
        group = session._group if session is not None else None
        if group is None or group.world_size < 2 or not (self._in_step or self._aligned):
            return None
        return group if tensor is not None and tensor.device.type != "cpu" else group.control

    def _collective(self, run: Callable[[], Any], local: Callable[[], Any]) -> Any:
        """``run`` over the group. Inside a step a failure is the step's (``attempt`` recovers it);
        between steps it makes this and every collective until the next step this rank's own: the
        peers are not at the same point any more, and the next step's reduction recovers."""
        if self._in_step:
            return run()
        try:
            return run()
        except CollectiveError as e:
            self._aligned = False
            log.warning("[rank %d] a collective between steps failed (%s): this rank's own values "
                        "until the next step", self.global_rank, e)  # fmt: skip
            return local()

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``sum``, ``mean``, ``max`` or ``min`` over the ranks (``group`` is ignored: one group)."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        op = _op(reduce_op)
        g = self._group(tensor)
        if g is None:
            return tensor

        def run() -> torch.Tensor:
            if op in ("sum", "mean"):
                out = tensor.detach().clone()
                if op == "mean" and not out.is_floating_point():
                    out = out.double()
                g.allreduce_([out])
                return out / g.world_size if op == "mean" else out
            gathered = torch.stack(g.allgather(tensor.detach().contiguous()))
            return gathered.amax(0) if op == "max" else gathered.amin(0)

        return self._collective(run, lambda: tensor)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor``, stacked in rank order (``(world_size, *shape)``)."""
        if sync_grads:
            raise ValueError("CheckpointlessStrategy does not support all_gather(sync_grads=True)")
        g = self._group(tensor)
        if g is None:
            return torch.stack([tensor] * self.world_size) if self.world_size > 1 else tensor
        return self._collective(
            lambda: torch.stack(g.allgather(tensor.detach().contiguous())),
            lambda: torch.stack([tensor] * self.world_size),
        )

    def barrier(self, name: str | None = None) -> None:
        g = self._group()
        if g is not None:
            self._collective(g.barrier, lambda: None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``src``'s ``obj`` if it is a ``str``, number, bool or None; any other object stays this
        rank's own (nothing received is unpickled; Lightning broadcasts paths and decisions)."""
        g = self._group()
        if g is None or not (obj is None or type(obj) in (str, int, float, bool)):
            return obj
        data = json.dumps(obj).encode()

        def run() -> Any:
            size = torch.tensor([len(data)], dtype=torch.int64)
            g.broadcast_([size], root=src)
            buf = torch.zeros(int(size.item()), dtype=torch.uint8)
            if g.rank == src:
                buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            g.broadcast_([buf], root=src)
            return json.loads(bytes(buf.tolist()))

        return self._collective(run, lambda: obj)
