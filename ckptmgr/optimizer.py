"""Creating an optimizer's lazily built state so that a checkpoint can be loaded into it."""

from __future__ import annotations

import torch


def prime_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Create the optimizer's per-parameter state by taking one step with zero gradients.

    Optimizers such as Adam/AdamW create their state (``step``, ``exp_avg``, ...) on the first
    ``step()``. An in-place restore needs those tensors to exist. Call this before ``restore``.

    Destructive: the step updates parameters (weight decay, momentum) and the state, so prime only
    an optimizer whose parameters and state are about to be overwritten by a restore. Gradients
    are reset to ``None`` afterwards. Returns ``optimizer``.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer
