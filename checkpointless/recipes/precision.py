"""Mixed precision for recipes: bf16 model, fp32 master weights inside the optimizer.

With ``parallel.dtype: bfloat16`` the model's parameters are bf16: forward,
backward and the data-parallel gradient reduction run on bf16 tensors (params
2 B, grads 2 B per parameter). Updating bf16 weights directly loses every update
smaller than half a bf16 unit in the last place (about 0.4% of the weight), so
long runs with a decayed learning rate stop learning. :class:`MasterWeightAdamW`
keeps an fp32 *master* copy of every parameter and is an ordinary
``torch.optim.AdamW`` over those masters (fp32 moments, fp32 update); the
model's bf16 parameters are only ever the masters rounded to nearest.

One optimizer step, as ``optimizer.step()`` runs it:

1. (step pre-hook) each bf16 ``param.grad`` (already reduced across ranks) is
   copied into an fp32 ``master.grad``; a copy made by :meth:`clip_grad_norm_`
   earlier in the step is used as is;
2. AdamW updates the fp32 masters and its fp32 moments;
3. (step post-hook) every bf16 parameter is set to its master, rounded to nearest
   (``Tensor.copy_``), and the fp32 grad copies are freed.

So the fp32 grad copy is transient (4 B per parameter during the step, like
activations it is not training state), and the persistent state is: bf16
params 2 B, bf16 grads 2 B, fp32 masters 4 B, fp32 moments 2 x 4 B per
parameter, plus one fp32 scalar step counter per parameter tensor, which is what
``checkpointless.recipes.dryrun`` reports.

Gradient clipping: :meth:`clip_grad_norm_` clips the fp32 grad copies, the grads
the optimizer actually uses: the norm is computed in fp32 over exact copies of
the reduced bf16 grads, and scaling them in fp32 adds no bf16 rounding. Call it
after the reduction and right before ``step()``.

Transferred state: ``state_dict()`` is AdamW's with each parameter's fp32
master added to its per-parameter state under ``"master"``, so the
``Session``'s ``"optimizer"`` entry carries the masters to a replacement (and
the state digest covers them); ``load_state_dict`` copies them back. A
recovered spare therefore continues from the same fp32 masters, bit for bit.
The LR scheduler is attached to this optimizer, which is the one that steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["MASTER_KEY", "MasterWeightAdamW"]

#: Key of the fp32 master weight in each parameter's entry of ``state_dict()["state"]``.
MASTER_KEY = "master"


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW over fp32 master copies of low-precision (bf16) model parameters.

    ``params`` are the model's parameters (one flat list; tied parameters are
    passed once, as ``model.parameters()`` does). The optimizer's own
    ``param_groups`` hold the fp32 masters, so an LR scheduler attached to it
    drives the update. The other arguments are ``torch.optim.AdamW``'s.

    ``zero_grad`` clears the model's grads (and any fp32 copies);
    ``model_params`` and ``masters`` are the two parallel lists.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **kwargs: Any,
    ) -> None:
        self.model_params: list[nn.Parameter] = list(params)
        if not self.model_params:
            raise ValueError("MasterWeightAdamW got an empty parameter list")
        if len({id(p) for p in self.model_params}) != len(self.model_params):
            raise ValueError("MasterWeightAdamW got a parameter twice (pass tied parameters once)")
        for p in self.model_params:
            if not p.is_floating_point():
                raise TypeError(f"MasterWeightAdamW: a parameter of dtype {p.dtype} is not floating point")
        self.masters: list[nn.Parameter] = [
            nn.Parameter(p.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad)
            for p in self.model_params
        ]
        self._grads_in = False  # the fp32 grad copies of this step exist (clip_grad_norm_ made them)
        super().__init__(self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
        self.register_step_pre_hook(lambda opt, args, kwargs: self._grads_to_masters())
        self.register_step_post_hook(lambda opt, args, kwargs: self._masters_to_model())

    # -- the step ---------------------------------------------------------------------
    @torch.no_grad()
    def _grads_to_masters(self) -> None:
        """Give each master an fp32 copy of its model parameter's grad (``None`` stays ``None``)."""
        if self._grads_in:
            return
        for p, m in zip(self.model_params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.detach().to(torch.float32, copy=True)
        self._grads_in = True

    @torch.no_grad()
    def _masters_to_model(self) -> None:
        """Round every master into its bf16 parameter and free the fp32 grad copies."""
        for p, m in zip(self.model_params, self.masters, strict=True):
            p.copy_(m)
            m.grad = None
        self._grads_in = False

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global norm of the grads the next ``step()`` uses (fp32 copies) to ``max_norm``.

        Returns the norm before clipping (fp32), as ``torch.nn.utils.clip_grad_norm_`` does.
        """
        self._grads_to_masters()
        return torch.nn.utils.clip_grad_norm_(self.masters, max_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's grads (zeroed in place or set to ``None``) and drop the fp32 copies."""
        for p in self.model_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()
        for m in self.masters:
            m.grad = None
        self._grads_in = False

    # -- transferable state -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """AdamW's state dict with every parameter's fp32 master under ``state[i]["master"]``.

        The tensors are the live ones (as ``Optimizer.state_dict`` returns them), not copies.
        """
        sd = super().state_dict()
        state = sd["state"]
        sd["state"] = {i: {**state.get(i, {}), MASTER_KEY: m} for i, m in enumerate(self.masters)}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict made by :meth:`state_dict`: masters into place, the rest into AdamW.

        The model's own parameters are loaded with the model (``nn.Module.load_state_dict``);
        they equal the masters rounded, as on the sender.
        """
        state = state_dict["state"]
        if set(state) != set(range(len(self.masters))):
            raise ValueError(
                f"optimizer state has entries {sorted(state)[:8]}..., expected one per each of the "
                f"{len(self.masters)} master weights (a state from a plain AdamW?)"
            )
        rest: dict[int, dict[str, Any]] = {}
        masters: list[torch.Tensor] = []
        for i, m in enumerate(self.masters):
            entry = dict(state[i])
            value = entry.pop(MASTER_KEY, None)
            if not isinstance(value, torch.Tensor) or value.shape != m.shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"optimizer state {i}: master weight {got}, expected {tuple(m.shape)}")
            masters.append(value)
            if entry:
                rest[i] = entry
        super().load_state_dict({**state_dict, "state": rest})
        with torch.no_grad():
            for m, value in zip(self.masters, masters, strict=True):
                m.copy_(value)
        self._grads_in = False
