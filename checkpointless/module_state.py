"""What of a module travels with its state besides the parameters and the optimizer: which
parameters train (``Trainable``), and the buffers across replicas and failed attempts
(``BufferSync``)."""

from __future__ import annotations

from typing import Any

import torch

from checkpointless.comm import Group


class Trainable:
    """Which parameters of a module train (``requires_grad``), as transferable state: a replacement
    that joins after the loop unfroze a parameter (progressive unfreezing, adapters) trains the
    same ones as its source, though its own code unfroze nothing."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._committed = self.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {"requires_grad": [p.requires_grad for p in self._module.parameters()]}

    def commit(self) -> None:
        """Remember the flags as they are (at a committed step)."""
        self._committed = self.state_dict()

    def restore(self) -> None:
        """Put back the committed flags: a failed attempt that unfroze a parameter re-executes the
        unfreezing, so the reduction's layout follows the same path as without the failure."""
        self.load_state_dict(dict(self._committed))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        flags = list(state["requires_grad"])
        params = list(self._module.parameters())
        if len(flags) != len(params):
            raise ValueError(f"trainable flags for {len(flags)} parameters, the model has {len(params)}")
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(bool(flag))
        self._committed = {"requires_grad": flags}  # a loaded state is a committed one


class BufferSync:
    """A module's buffers (BatchNorm running statistics, counters) across replicas and failed attempts.

    - ``sync``: every replica takes rank 0's buffers. ``DistributedDataParallel(broadcast_buffers=True)``,
      its default, broadcasts rank 0's buffers before every forward pass, so every rank's forward sees
      rank 0's statistics. ``sync`` does the same after a step's forward and backward passes
      (from ``reduce_gradients``): every forward still sees rank 0's buffers of the step before, and,
      unlike with DDP, every replica also *holds* them when the step commits, so any replica can be
      the source of a recovery. One broadcast per dtype (buffers packed into flat buckets). With
      gloo on CPU only at a step where some rank's buffers moved since the last commit
      (``changed``; the ranks agree through a flag the gradient reduction carries): never for
      buffers that stay constant. On an accelerator at every step, as DDP does: reading the flag
      would make the host wait for the reduction.
    - ``commit`` / ``restore``: a failed attempt's forward pass has already updated the buffers
      (BatchNorm does so in place); ``restore`` puts back the copy ``commit`` took at the last
      committed step, so that the step re-executes from exactly the committed state.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.buffers = [b for _, b in module.named_buffers()]
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for b in self.buffers:
            by_dtype.setdefault((b.dtype, b.device), []).append(b)
        self._groups = [
            (torch.zeros(sum(b.numel() for b in members), dtype=dtype, device=device), members)
            for (dtype, device), members in by_dtype.items()
        ]
        self._saved = [torch.zeros_like(flat) for flat, _ in self._groups]
        self.synced = False  # whether ``sync`` ran since this object was made (a generation's first)
        self.commit()

    def __bool__(self) -> bool:
        return bool(self.buffers)

    def _pack(self, into: list[torch.Tensor]) -> None:
        for (_, members), flat in zip(self._groups, into, strict=True):
            if members:
                torch.cat([b.detach().reshape(-1) for b in members], out=flat)

    def _unpack(self, source: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for (_, members), flat in zip(self._groups, source, strict=True):
                off = 0
                for b in members:
                    b.copy_(flat[off : off + b.numel()].view_as(b))
                    off += b.numel()

    def sync(self, group: Group | None, root: int = 0) -> None:
        """Overwrite every member's buffers with ``root``'s (no-op alone)."""
        if group is None or group.world_size == 1 or not self.buffers:
            return
        flats = [flat for flat, _ in self._groups]
        self._pack(flats)
        group.broadcast_(flats, root)
        self._unpack(flats)
        self.synced = True

    def changed(self) -> bool:
        """Whether any buffer differs, bit for bit, from the copy ``commit`` took (a forward pass in
        training mode moved BatchNorm's statistics; a constant buffer such as a rotary table never)."""
        flats = [flat for flat, _ in self._groups]
        self._pack(flats)
        return any(
            not torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(flats, self._saved, strict=True)
        )

    def commit(self) -> None:
        """Remember the buffers as they are (at a committed step)."""
        self._pack(self._saved)

    def restore(self) -> None:
        """Put back the buffers ``commit`` remembered (after a failed attempt)."""
        self._unpack(self._saved)

    def snapshot(self) -> list[torch.Tensor]:
        """A copy of the buffers as they are (``load`` puts it back)."""
        copy = [torch.empty_like(flat) for flat, _ in self._groups]
        self._pack(copy)
        return copy

    def load(self, snapshot: list[torch.Tensor]) -> None:
        self._unpack(snapshot)
