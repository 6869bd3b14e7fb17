"""Creating an optimizer's lazily built state so that a checkpoint can be loaded into it."""

from __future__ import annotations

from collections.abc import Collection

import torch

from ckptmgr.errors import CheckpointError


def prime_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Create the optimizer's per-parameter state by taking one step with zero gradients.

    Optimizers such as Adam/AdamW create their state (``step``, ``exp_avg``, ...) on the first
    ``step()``. An in-place restore needs those tensors to exist. Call this before ``restore``
    when you restore into a plain ``optimizer.state_dict()``; ``restore`` creates the state of
    ``Optimizer`` objects itself.

    Destructive: the step updates parameters (weight decay, momentum) and the state, so prime only
    an optimizer whose parameters and state are about to be overwritten by a restore. Gradients
    are reset to ``None`` afterwards. Returns ``optimizer``.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    _step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _step(optimizer: torch.optim.Optimizer) -> None:
    """One ``optimizer.step()``; ``CheckpointError`` for an optimizer whose step needs a
    closure (``LBFGS``), whose state cannot be made that way (nor restored in place: its
    history is lists of a length that changes from step to step)."""
    try:
        optimizer.step()
    except TypeError as exc:
        if "closure" not in str(exc):
            raise
        raise CheckpointError(
            f"the state of {type(optimizer).__name__} cannot be made for a restore: its step() "
            f"needs a closure ({exc}); ckptmgr restores optimizers whose step() takes none"
        ) from exc


def create_state(
    optimizer: torch.optim.Optimizer, params: Collection[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Create the lazily built per-parameter state of the parameters that have none yet
    (of those in ``params``, when given).

    Takes one step with zero gradients for those parameters only (the others have no gradient
    during it, so the step leaves them and their state alone) and every learning rate set to
    0, as ``torch.distributed.checkpoint.state_dict`` does, so that standard optimizers leave
    the parameters unchanged; the learning rates and the gradients are put back afterwards, and
    so are those parameters' values (an optimizer whose update does not scale with the learning
    rate, or applies a weight decay of its own, would have moved them).
    The state it creates is meant to be overwritten by a restore. Does nothing when every such
    parameter has state. Returns the parameters whose state it created.
    """
    wanted = None if params is None else {id(param) for param in params}
    grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    rates: list[tuple[dict, object]] = []
    creating: list[torch.Tensor] = []
    try:
        for group in optimizer.param_groups:
            for param in group["params"]:
                grads.append((param, param.grad))
                lacking = param not in optimizer.state and (wanted is None or id(param) in wanted)
                if lacking:  # (a frozen parameter too: its saved state is restored)
                    param.grad = torch.zeros_like(param)
                    creating.append(param)
                else:
                    param.grad = None
            if "lr" in group:
                rates.append((group, group["lr"]))
                lr = group["lr"]
                group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        if creating:
            with torch.no_grad():
                values = [param.detach().clone() for param in creating]
                _step(optimizer)
                for param, value in zip(creating, values, strict=True):
                    param.copy_(value)  # (an update that does not scale with the lr moved it)
    finally:
        for group, lr in rates:
            group["lr"] = lr
        for param, grad in grads:
            param.grad = grad
    return creating
