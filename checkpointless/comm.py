"""Process-group lifecycle, one group per generation.

A group is built on its generation's store prefix (``keys.pg_prefix``), so a new
generation never meets the keys of an old one. A replicated session's data-plane group is also the
process's ``torch.distributed`` default group for its generation (``default=True``: a script's
``dist.get_rank()``, ``DistributedSampler(dataset)`` and own collectives use it), formed with
``init_process_group`` on that prefix and destroyed by ``abort``, so that the next generation can
form its own; other groups (an NCCL group's control group, tools') are plain ``ProcessGroup``
objects that touch no global state.

Failure semantics: any collective that fails (a peer died, the group was
aborted, a timeout) raises ``CollectiveError``. ``abort`` *destroys* this
process's group, which closes its connections and makes every peer's pending
collective on the group fail too (seen with 4 ranks: a rank blocked in the
ring all-reduce on a live neighbour is released as soon as that neighbour
drops its group). ``ProcessGroupGloo.abort()`` alone does not close
anything: the sockets live as long as the group object or any of its pending
``Work`` objects, so no ``Work`` outlives a failed call but in the group's own table of works
not yet waited for, which ``abort`` empties (a ``CollectiveError`` carries no reference to one),
and the session clears the frames of a failure's traceback before it aborts. A collective blocked on a
*stopped* peer is not released by anything but that peer's death (DESIGN.md):
the coordinator kills such a peer.

``release`` fails every pending collective of a group from any thread, while the owner may be
blocked in one: its connections are shut down at the socket level (``sockets.py``; NCCL's
communicator is aborted). A member leaves its generation that way when the coordinator aborted
it while its collectives still work (a host cut off from the coordinator but not from its peers,
a member declared dead that is not): the session's heartbeat thread sees the abort and releases
the group, and the blocked collective raises ``CollectiveError`` in the main thread.

How a wait on a collective gives up once its group is released, what an abort keeps aside until
its collectives have ended, and the groups aborted at the interpreter's exit: ``group_works.py``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from checkpointless.errors import CollectiveError
from checkpointless.group_works import Works, graveyard, live, sweep
from checkpointless.sockets import (
    exchange_listeners,
    group_connections,
    listeners,
    shutdown_sockets,
    sockets,
    sockets_since,
)

log = logging.getLogger(__name__)

_BACKEND_MARKS = ("gloo", "NCCL", "ProcessGroup", "Connection reset", "Connection closed")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective: ours (``CollectiveError``) or one raised inside a
    library's collective (FSDP2's all-gather in ``forward``: gloo raises a bare ``RuntimeError``
    naming its transport, so the message is the only mark)."""
    if isinstance(exc, CollectiveError | dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _BACKEND_MARKS)


class Group:
    """The data-plane group of one generation (gloo on CPU, NCCL on GPU), with its control group.

    ``control`` is a gloo group of the same members for the small CPU messages that steer the
    job (barriers, the buffer-sync flag, digest all-gathers, the layout check, a state transfer's
    header, metadata and trailer): NCCL takes CUDA tensors only. A gloo group is its own
    ``control``; an NCCL group forms one on its store prefix + ``ctl/``.

    ``device``: the device whose tensors the data plane moves point to point as they are (``cpu``
    for gloo, which also reduces and broadcasts CUDA tensors but sends raw host pointers point to
    point; the CUDA device for NCCL). ``state.send_state`` stages a tensor on another device
    through a buffer on this one, or sends it over ``control`` if it is a CPU tensor.

    Waits on NCCL work block the host until the GPU has done the work (``wait_all``, ``wait``):
    a reduction that returns has completed, so a step is never committed on a reduction that is
    still in flight (``Session``'s protocol needs it).
    """

    _fds: dict[int, str]  # the connections this group opened (``release`` shuts them down)

    def __init__(
        self,
        store: dist.Store,
        gen: int,
        rank: int,
        world_size: int,
        *,
        prefix: str | None = None,
        backend: str = "gloo",
        timeout: timedelta = timedelta(seconds=60),
        device: torch.device | None = None,
        default: bool = False,
    ) -> None:
        """Collective over all members of generation ``gen``: every member must call it.

        ``prefix`` is the store prefix of the rendezvous (the session passes the
        generation's unguessable one, ``keys.pg_prefix``); tools and tests may omit it.
        ``device``: NCCL's CUDA device (default: the current one); gloo's is the CPU.
        ``default``: the group is also the process's ``torch.distributed`` default group (what
        ``dist.get_rank()``, ``DistributedSampler(dataset)`` and a script's own ``dist.all_reduce``
        use) until ``abort`` destroys it; none may exist yet.
        """
        self.gen, self.rank, self.world_size = gen, rank, world_size
        self.backend = backend
        self.control: Group = self
        self._works = Works(gen, backend, owned=True, released=self._is_released)
        self._default = default
        sweep()
        prefix = prefix or f"pg/{gen}/"
        prefixed = dist.PrefixStore(prefix, store)
        if default and dist.is_initialized():
            raise RuntimeError("a torch.distributed default group already exists in this process")
        before = sockets()
        try:
            if backend not in ("gloo", "nccl"):
                raise ValueError(f"unknown backend {backend!r} (expected gloo or nccl)")
            if default:
                # as fsdp.Generation: a formation that failed before its default group existed
                # leaves torch's group counter advanced, and the ranks' group names would differ
                from checkpointless._compat import reset_group_count

                reset_group_count()
                dist.init_process_group(
                    backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout
                )
                self.pg: Any = dist.group.WORLD
                self.device = (
                    torch.device("cpu")
                    if backend == "gloo"
                    else device or torch.device("cuda", torch.cuda.current_device())
                )
            elif backend == "gloo":
                self.device = torch.device("cpu")
                self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            elif backend == "nccl":
                self.device = device or torch.device("cuda", torch.cuda.current_device())
                opts = dist.ProcessGroupNCCL.Options()
                from checkpointless._compat import set_nccl_timeout

                set_nccl_timeout(opts, timeout)  # a private name, behind the version gate
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
            # this group's connections (``release``): those its listeners accepted, and those to
            # the peers' listeners, which every member publishes on the rendezvous prefix
            new = sockets_since(before)
            peers = exchange_listeners(prefixed, rank, world_size, listeners(new), timeout)
            self._fds = group_connections(new, peers=peers)
        except ValueError:
            raise
        except RuntimeError as e:  # gloo and NCCL errors (torch.distributed.DistError is one)
            if default and dist.is_initialized():  # formed, then the listeners' exchange failed
                self._fds = group_connections(sockets_since(before))
                shutdown_sockets(self._fds)
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
            raise CollectiveError(f"gen {gen}: group formation failed: {e}") from None
        self._owned = True
        self._released = False
        live.add(self)
        self._owner_released: Callable[[], bool] | None = None
        if backend != "gloo":
            try:
                self.control = Group(store, gen, rank, world_size, prefix=prefix + "ctl/", timeout=timeout)
            except CollectiveError:
                self.abort()
                raise

    @classmethod
    def wrap(
        cls, pg: Any, gen: int, rank: int, world_size: int, *, backend: str = "gloo",
        device: torch.device | None = None, released: Callable[[], bool] | None = None,
    ) -> Group:  # fmt: skip
        """A ``Group`` over an existing ``ProcessGroup`` (a sharded generation's default group).

        Its owner tears it down (``fsdp.Generation.close``); ``abort`` only drops the reference
        (and aborts ``control`` if the caller gave it one of its own). ``released``: whether the
        owner released it (a point-to-point wait then gives up, as on a group of this module's).
        """
        self = cls.__new__(cls)
        self.gen, self.rank, self.world_size, self.pg = gen, rank, world_size, pg
        self.backend, self.control = backend, self
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if backend == "nccl"
                else torch.device("cpu")
            )
        self.device = device
        self._owned = self._default = False
        self._fds = {}
        self._released = False
        self._owner_released = released
        self._works = Works(gen, backend, owned=False, released=self._is_released)
        return self

    def _settle(self) -> None:
        """NCCL: block the host until the current stream has done the group's work (``wait`` on an
        NCCL ``Work`` only orders the stream after it)."""
        if self.backend == "nccl":
            torch.cuda.current_stream(self.device).synchronize()

    def _is_released(self) -> bool:
        return self._released or (self._owner_released is not None and self._owner_released())

    def allreduce_(self, tensors: list[torch.Tensor]) -> None:
        """Sum each tensor in place across the group (all issued, then all awaited)."""
        works: list[Any] = []
        try:
            works.extend(self.allreduce_start(t) for t in tensors)
        except CollectiveError:
            works.clear()
            raise
        self.wait_all(works)

    def allreduce_start(self, tensor: torch.Tensor) -> Any:
        """Start summing ``tensor`` in place across the group; finish with ``wait_all``.

        Members must start their collectives in the same order.
        """
        try:
            return self._works.track(self.pg.allreduce([tensor]))
        except RuntimeError as e:  # gloo and NCCL errors (torch.distributed.DistError is one)
            raise CollectiveError(f"gen {self.gen}: allreduce failed: {e}") from None

    def writing(self) -> bool:
        """Whether a collective of this group may still write into its tensors: one not yet
        waited for, or one still running when the group was aborted, that has not ended."""
        return self._works.writing()

    def wait_all(self, works: list[Any]) -> None:
        """Wait for ``works`` (from ``allreduce_start``) in order. Empties the list, failed or not:
        a live Work keeps the group's sockets open (see the module doc)."""
        try:
            for w in works:
                self._works.wait(w, "allreduce")
            self._settle()
        finally:
            works.clear()

    def broadcast_(self, tensors: list[torch.Tensor], root: int = 0) -> None:
        """Overwrite each tensor with ``root``'s, in place on every member (all issued, then all awaited)."""
        works: list[Any] = []
        try:
            for t in tensors:
                opts = dist.BroadcastOptions()
                opts.rootRank = root
                works.append(self._works.track(self.pg.broadcast([t], opts)))
        except RuntimeError as e:  # gloo and NCCL errors (torch.distributed.DistError is one)
            works.clear()  # a live Work keeps the group's sockets open (see module doc)
            raise CollectiveError(f"gen {self.gen}: broadcast failed: {e}") from None
        try:
            for w in works:
                self._works.wait(w, "broadcast")
            self._settle()
        finally:
            works.clear()

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``tensor`` (same shape and dtype on all), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        try:
            work = self._works.track(self.pg.allgather([out], [tensor]))
        except RuntimeError as e:  # gloo and NCCL errors (torch.distributed.DistError is one)
            raise CollectiveError(f"gen {self.gen}: allgather failed: {e}") from None
        self._works.wait(work, "allgather")
        del work
        self._settle()
        return out

    def alltoall(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> None:
        """Send ``inp``'s ``in_splits[j]`` elements (in order) to member j; receive member i's into
        ``out``'s ``out_splits[i]`` elements, in rank order."""
        try:
            work = self._works.track(
                self.pg.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions())
            )
        except RuntimeError as e:  # gloo and NCCL errors (torch.distributed.DistError is one)
            raise CollectiveError(f"gen {self.gen}: alltoall failed: {e}") from None
        self._works.wait(work, "alltoall")
        del work
        self._settle()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """Start sending ``tensor`` to ``dst``; finish with ``wait``. Messages match by tag."""
        try:
            return self._works.track(self.pg.send([tensor], dst, tag), p2p=True)
        except RuntimeError as e:  # gloo and NCCL errors (torch.distributed.DistError is one)
            raise CollectiveError(f"gen {self.gen}: send to rank {dst} failed: {e}") from None

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        """Start receiving into ``tensor`` from ``src``; finish with ``wait``."""
        try:
            return self._works.track(self.pg.recv([tensor], src, tag), p2p=True)
        except RuntimeError as e:  # gloo and NCCL errors (torch.distributed.DistError is one)
            raise CollectiveError(f"gen {self.gen}: recv from rank {src} failed: {e}") from None

    def wait(self, work: Any) -> None:
        """Wait for an ``isend``/``irecv``."""
        self._works.wait(work, "point-to-point transfer")
        self._settle()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to ``dst`` and wait until it went (tag 0)."""
        try:
            work = self.pg.send([tensor], dst, 0)
        except RuntimeError as e:  # gloo and NCCL errors (torch.distributed.DistError is one)
            raise CollectiveError(f"gen {self.gen}: send to rank {dst} failed: {e}") from None
        self._works.wait(work, f"send to rank {dst}", p2p=True)
        del work
        self._settle()

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receive ``tensor`` from ``src`` (tag 0)."""
        try:
            work = self.pg.recv([tensor], src, 0)
        except RuntimeError as e:  # gloo and NCCL errors (torch.distributed.DistError is one)
            raise CollectiveError(f"gen {self.gen}: recv from rank {src} failed: {e}") from None
        self._works.wait(work, f"recv from rank {src}", p2p=True)
        del work
        self._settle()

    def barrier(self) -> None:
        """Every member reaches this point (one CPU number, on the control group)."""
        ctl = self.control
        if ctl is not self:
            ctl.barrier()
            return
        self.allreduce_([torch.zeros(1)])

    def use_control(self, group: Group) -> None:
        """Carry this group's small control messages (barriers, digests, headers) on ``group``, a
        gloo group of the same generation (the data plane runs on an accelerator's backend)."""
        self.control = group

    def release(self) -> None:
        """Fail every pending collective of this group at once, here and on its peers; safe from
        any thread while another is blocked in a collective (see the module doc). The group is
        unusable afterwards; its owner still calls ``abort``. A wrapped group's owner releases it."""
        ctl = self.control
        if ctl is not self:
            ctl.release()
        if self._released or not self._owned:
            return
        self._released = True
        pg = self.pg
        if self.backend == "nccl" and pg is not None:
            try:
                pg.abort()
            except Exception:  # already torn down
                log.debug("gen %d: NCCL abort raised", self.gen, exc_info=True)
        n = shutdown_sockets(self._fds)
        log.debug("gen %d rank %d: released, %d connections shut down", self.gen, self.rank, n)

    def abort(self) -> None:
        """Destroy this member's group so that its connections close and peers' pending collectives fail.

        The caller must hold no ``Work`` of this group (``attempt`` clears a
        failure's traceback first); the group is unusable afterwards. Its control group goes too.
        """
        ctl, self.control = self.control, self
        if ctl is not self:
            ctl.abort()
        running = self._works.abandon()
        live.discard(self)
        pg, self.pg = self.pg, None
        if pg is None or not self._owned:
            return
        try:
            pg.abort()
        except Exception:  # already torn down by the failure itself
            log.debug("gen %d: abort raised", self.gen, exc_info=True)
        if running and self.backend == "gloo":
            # its destructor would wait for them (see the module doc): the peers see the
            # connections shut down instead, and the group goes once they have ended
            n = shutdown_sockets(self._fds)
            graveyard.append((pg, running))
            log.debug("gen %d rank %d: aborted with %d collectives running, %d connections shut down",
                      self.gen, self.rank, len(running), n)  # fmt: skip
        if (
            self._default and dist.is_initialized() and dist.group.WORLD is pg
        ):  # (not destroyed by the script)
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        del pg  # the last reference (unless kept aside): ~ProcessGroupGloo closes the sockets
        sweep()
