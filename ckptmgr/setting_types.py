"""Number types of the settings models (``CheckpointConfig``, ``RetryConfig``,
``PreemptionConfig``): numbers as pydantic reads them, a number written as text included (YAML's
``1e3``, which PyYAML reads as a string), but not a bool, which pydantic takes for 1 or 0
(``collective_timeout_s=True`` was a timeout of one second)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        raise ValueError(f"a bool is not a number here: {value!r}")  # (numpy's np.True_ too)
    return value


Seconds = Annotated[float, BeforeValidator(_not_a_bool)]
"""A duration in seconds (other constraints, such as ``gt=0``, are the field's)."""
Count = Annotated[int, BeforeValidator(_not_a_bool)]
"""A number of things (attempts, seconds of a long poll)."""
