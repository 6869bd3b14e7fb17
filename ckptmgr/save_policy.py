"""Save policies: at which steps to take a checkpoint.

A policy is one small object with one method, ``should_save(context) -> bool``. The manager asks
every policy at each step it is asked about (``should_save``/``save``/``save_async``) and saves
when any says yes. The decision is taken on rank 0 and broadcast, so every rank saves the same
steps even when a policy reads a clock. A preemption notice always adds a save, whatever the
policies say.

Writing your own::

    class SaveWhenLossImproves:
        def __init__(self) -> None:
            self.best = float("inf")

        def should_save(self, context: SaveContext) -> bool:
            ...

The built-in policies are pydantic dataclasses tagged with ``type`` so that configuration files
can name them (``{"type": "save_every_n_seconds", "seconds": 1800}``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import Field, TypeAdapter
from pydantic.dataclasses import dataclass as policy_dataclass

from ckptmgr.retention import POLICY_CONFIG, NamedArguments, PositiveInt, PositiveSeconds


@dataclass(frozen=True)
class SaveContext:
    """What a save policy may look at when deciding on one step."""

    step: int
    """The step being decided."""
    first_step: int
    """The first step this manager decided on (equal to ``step`` on the first decision)."""
    last_save_step: int | None
    """The step of the last save this manager started, or None before its first save."""
    seconds_since_last_save: float
    """Wall-clock seconds since this manager last started a save (or since it was created)."""


@runtime_checkable
class SavePolicy(Protocol):
    """Decides whether to save at a step."""

    def should_save(self, context: SaveContext) -> bool:
        """True to take a checkpoint at ``context.step``."""
        ...


@policy_dataclass(frozen=True, config=POLICY_CONFIG)
class SaveEveryNSteps(NamedArguments):
    """Save at every step that is a multiple of ``n`` (what ``save_interval=n`` means)."""

    n: PositiveInt
    type: Literal["save_every_n_steps"] = field(default="save_every_n_steps", repr=False)

    def should_save(self, context: SaveContext) -> bool:
        """``step % n == 0``."""
        return context.step % self.n == 0


@policy_dataclass(frozen=True, config=POLICY_CONFIG)
class SaveEveryNSeconds(NamedArguments):
    """Save when ``seconds`` of wall-clock time have passed since the last save started.

    Before the manager's first save the clock runs from the manager's creation.
    """

    seconds: PositiveSeconds
    type: Literal["save_every_n_seconds"] = field(default="save_every_n_seconds", repr=False)

    def should_save(self, context: SaveContext) -> bool:
        """At least ``seconds`` since the last save."""
        return context.seconds_since_last_save >= self.seconds


@policy_dataclass(frozen=True, config=POLICY_CONFIG)
class SaveAtSteps(NamedArguments):
    """Save at the listed steps."""

    steps: frozenset[Annotated[int, Field(strict=True, ge=0)]]
    type: Literal["save_at_steps"] = field(default="save_at_steps", repr=False)

    def should_save(self, context: SaveContext) -> bool:
        """``step`` is listed."""
        return context.step in self.steps


@policy_dataclass(frozen=True, config=POLICY_CONFIG)
class SaveFirstStep(NamedArguments):
    """Save at the first step this manager decides on, so a broken setup fails early.

    After a restart that restores step N, the first step decided is usually N itself, which is
    already committed, and nothing is saved again.
    """

    type: Literal["save_first_step"] = field(default="save_first_step", repr=False)

    def should_save(self, context: SaveContext) -> bool:
        """The step is the first one decided."""
        return context.step == context.first_step


SavePolicySpec = Annotated[
    SaveEveryNSteps | SaveEveryNSeconds | SaveAtSteps | SaveFirstStep,
    Field(discriminator="type"),
]
"""A built-in save policy, as an object or as a mapping tagged with ``type``."""

_SPEC_ADAPTER: TypeAdapter[Any] = TypeAdapter(SavePolicySpec)


def parse_save_policy(value: Any) -> SavePolicy:
    """A policy object as given, or a built-in one from ``{"type": ..., **fields}``."""
    if isinstance(value, Mapping):
        return _SPEC_ADAPTER.validate_python(dict(value))
    if isinstance(value, SavePolicy):
        return value
    raise ValueError(
        f"a save policy must be an object with should_save(context) or a mapping with a "
        f"'type' key, got {type(value).__qualname__}"
    )


def is_rank_independent(policy: SavePolicy) -> bool:
    """True for built-in policies that give every rank the same answer without a clock."""
    return isinstance(policy, (SaveEveryNSteps, SaveAtSteps, SaveFirstStep))


@dataclass
class SaveSchedule:
    """The manager's save policies and the little history they look at."""

    policies: list[SavePolicy]
    created_at: float
    first_step: int | None = None
    last_save_step: int | None = None
    last_save_at: float | None = None

    def wants(self, step: int, now: float) -> bool:
        """True if any policy wants a save at ``step`` (recording ``step`` as the first)."""
        if self.first_step is None:
            self.first_step = step
        since = now - (self.last_save_at if self.last_save_at is not None else self.created_at)
        context = SaveContext(step, self.first_step, self.last_save_step, max(since, 0.0))
        # Every policy is asked (no short-circuit): a stateful policy sees every step.
        answers = [policy.should_save(context) for policy in self.policies]
        return any(answers)

    def started(self, step: int, now: float) -> None:
        """Record that a save of ``step`` started at ``now``."""
        self.last_save_step = step
        self.last_save_at = now


def schedule_from(
    save_interval: int | None, policies: Iterable[SavePolicy], created_at: float
) -> SaveSchedule:
    """The schedule for ``save_interval`` (if any) plus ``policies``."""
    combined: list[SavePolicy] = [SaveEveryNSteps(save_interval)] if save_interval else []
    combined.extend(policies)
    return SaveSchedule(combined, created_at)
