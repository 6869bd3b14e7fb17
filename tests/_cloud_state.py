"""Deterministic training-like states for the cloud tests, shared by tests and child processes.

Every value of :func:`make_state` is a function of ``seed``, so a child process that saved a step
and the test that restores it agree on what the step must contain, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch


def make_state(seed: int, size: int = 4096) -> dict[str, Any]:
    """A state with several dtypes, a scalar, an empty tensor and plain values."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "weight": torch.randn(size // 64, 64, generator=gen),
            "bias": torch.randn(size // 8, generator=gen).to(torch.bfloat16),
            "ids": torch.randint(-(2**40), 2**40, (size // 16,), generator=gen),
            "mask": torch.rand(size // 32, generator=gen) > 0.5,
            "scale": torch.tensor(seed * 1.25, dtype=torch.float64),
            "empty": torch.empty(0, 3),
        },
        "progress": {"step": seed, "tag": f"seed-{seed}", "lr": 0.1 / (seed + 1)},
    }


def blank_like(state: dict[str, Any]) -> dict[str, Any]:
    """A state with the structure of ``state`` and values that no seed produces."""
    model = {key: torch.full_like(value, 7) for key, value in state["model"].items()}
    return {"model": model, "progress": {"step": -1, "tag": "", "lr": -1.0}}


def differences(actual: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """Where ``actual`` differs from ``expected`` bit for bit (dtypes and shapes included)."""
    found = []
    for key, want in expected["model"].items():
        got = actual["model"][key]
        if got.dtype != want.dtype or got.shape != want.shape:
            found.append(
                f"model/{key}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"
            )
        elif not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
            found.append(f"model/{key}: bytes differ")
    if actual["progress"] != expected["progress"]:
        found.append(f"progress: {actual['progress']} != {expected['progress']}")
    return found
