"""Save policies: each built-in's decision, user policies, the schedule the manager keeps, and
parsing from configuration mappings and files.

No clock is read and nothing sleeps: contexts are built by hand and the schedule is given
explicit ``now`` values (seconds on an arbitrary monotonic scale).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ckptmgr import CheckpointConfig
from ckptmgr.retention import KeepEveryNSteps, KeepLatest
from ckptmgr.save_policy import (
    SaveAtSteps,
    SaveContext,
    SaveEveryNSeconds,
    SaveEveryNSteps,
    SaveFirstStep,
    SavePolicy,
    SaveSchedule,
    parse_save_policy,
    schedule_from,
)


def ctx(
    step: int, first_step: int = 0, last_save_step: int | None = None, since: float = 0.0
) -> SaveContext:
    return SaveContext(
        step=step,
        first_step=first_step,
        last_save_step=last_save_step,
        seconds_since_last_save=since,
    )


# -- user policies (real classes, as a user would write them) --------------------------------------
class SaveAtPowersOfTwo:
    """Save at steps 1, 2, 4, 8, ..."""

    def should_save(self, context: SaveContext) -> bool:
        return context.step > 0 and context.step & (context.step - 1) == 0


class SaveEveryNAfterWarmup:
    """Nothing during warm-up, then every ``n`` steps counted from the end of warm-up."""

    def __init__(self, warmup: int, n: int) -> None:
        self.warmup = warmup
        self.n = n

    def should_save(self, context: SaveContext) -> bool:
        return context.step >= self.warmup and (context.step - self.warmup) % self.n == 0


class SaveWhenStepsSinceLastSave:
    """Save when ``k`` steps have passed since the last save (or before any save)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def should_save(self, context: SaveContext) -> bool:
        return context.last_save_step is None or context.step - context.last_save_step >= self.k


class Recording:
    """Answers ``answer`` and records every context it is asked about."""

    def __init__(self, answer: bool = False) -> None:
        self.answer = answer
        self.seen: list[SaveContext] = []

    def should_save(self, context: SaveContext) -> bool:
        self.seen.append(context)
        return self.answer


# -- each policy's decision ------------------------------------------------------------------------
SHOULD_SAVE_CASES = [
    pytest.param(SaveEveryNSteps(100), ctx(0), True, id="steps-0"),
    pytest.param(SaveEveryNSteps(100), ctx(100), True, id="steps-100"),
    pytest.param(SaveEveryNSteps(100), ctx(1000, since=0.0), True, id="steps-1000"),
    pytest.param(SaveEveryNSteps(100), ctx(99), False, id="steps-99"),
    pytest.param(SaveEveryNSteps(100), ctx(250, since=1e9), False, id="steps-ignores-time"),
    pytest.param(SaveEveryNSteps(1), ctx(7), True, id="steps-n1"),
    pytest.param(SaveEveryNSeconds(1800), ctx(1, since=0.0), False, id="seconds-none-passed"),
    pytest.param(SaveEveryNSeconds(1800), ctx(1, since=1799.999), False, id="seconds-just-short"),
    pytest.param(SaveEveryNSeconds(1800), ctx(1, since=1800.0), True, id="seconds-exactly"),
    pytest.param(SaveEveryNSeconds(1800), ctx(3, since=5000.0), True, id="seconds-long-after"),
    pytest.param(SaveEveryNSeconds(0.5), ctx(3, since=0.5), True, id="seconds-fraction"),
    pytest.param(
        SaveEveryNSeconds(60), ctx(100, last_save_step=100, since=0.0), False, id="seconds-reset"
    ),
    pytest.param(SaveAtSteps(frozenset({10, 20})), ctx(10), True, id="at-10"),
    pytest.param(SaveAtSteps(frozenset({10, 20})), ctx(20), True, id="at-20"),
    pytest.param(SaveAtSteps(frozenset({10, 20})), ctx(15), False, id="at-15"),
    pytest.param(SaveAtSteps(frozenset({10, 20})), ctx(0), False, id="at-0"),
    pytest.param(SaveAtSteps(frozenset()), ctx(0), False, id="at-nothing"),
    pytest.param(SaveFirstStep(), ctx(0, first_step=0), True, id="first-0"),
    pytest.param(SaveFirstStep(), ctx(37, first_step=37), True, id="first-37"),
    pytest.param(SaveFirstStep(), ctx(38, first_step=37), False, id="first-later"),
    pytest.param(
        SaveFirstStep(), ctx(5000, first_step=5000, last_save_step=None), True, id="first-resumed"
    ),
    # User policies.
    pytest.param(SaveAtPowersOfTwo(), ctx(64), True, id="user-pow2-64"),
    pytest.param(SaveAtPowersOfTwo(), ctx(96), False, id="user-pow2-96"),
    pytest.param(SaveAtPowersOfTwo(), ctx(0), False, id="user-pow2-0"),
    pytest.param(SaveEveryNAfterWarmup(1000, 250), ctx(500), False, id="user-warmup-during"),
    pytest.param(SaveEveryNAfterWarmup(1000, 250), ctx(1000), True, id="user-warmup-end"),
    pytest.param(SaveEveryNAfterWarmup(1000, 250), ctx(1250), True, id="user-warmup-after"),
    pytest.param(SaveEveryNAfterWarmup(1000, 250), ctx(1100), False, id="user-warmup-between"),
    pytest.param(SaveWhenStepsSinceLastSave(50), ctx(3), True, id="user-since-no-save-yet"),
    pytest.param(
        SaveWhenStepsSinceLastSave(50), ctx(149, last_save_step=100), False, id="user-since-49"
    ),
    pytest.param(
        SaveWhenStepsSinceLastSave(50), ctx(150, last_save_step=100), True, id="user-since-50"
    ),
]


@pytest.mark.parametrize(("policy", "context", "expected"), SHOULD_SAVE_CASES)
def test_should_save(policy: SavePolicy, context: SaveContext, expected: bool) -> None:
    assert isinstance(policy, SavePolicy)
    assert policy.should_save(context) is expected


def test_save_context_is_frozen() -> None:
    context = ctx(3)
    with pytest.raises(AttributeError):
        context.step = 4  # type: ignore[misc]


# -- the schedule ----------------------------------------------------------------------------------
# One timeline: (step, now, expected wants(), whether the caller then starts a save).
Timeline = list[tuple[int, float, bool, bool]]

SCHEDULE_CASES = [
    pytest.param(
        100,
        [],
        [
            (0, 0.0, True, True),
            (50, 1.0, False, False),
            (100, 2.0, True, True),
            (101, 3.0, False, False),
        ],
        id="save_interval-only",
    ),
    pytest.param(
        None,
        [SaveEveryNSeconds(1800)],
        [
            (1, 1000.0, False, False),  # clock runs from created_at=0 before the first save
            (2, 1799.5, False, False),
            (3, 1800.0, True, True),
            (4, 1801.0, False, False),  # the clock restarted at the save of step 3
            (5, 3599.0, False, False),
            (6, 3600.0, True, True),
        ],
        id="every-n-seconds",
    ),
    pytest.param(
        None,
        [SaveEveryNSeconds(1800)],
        [
            (1, 2000.0, True, False),  # wanted but not started (e.g. the step was taken)
            (2, 2001.0, True, True),  # still wanted: only a started save restarts the clock
            (3, 2002.0, False, False),
        ],
        id="every-n-seconds-wants-is-not-started",
    ),
    pytest.param(
        None,
        [SaveEveryNSeconds(10)],
        [(1, 5.0, False, True), (2, 14.0, False, False), (3, 15.0, True, True)],
        id="every-n-seconds-forced-save-restarts-clock",  # started() without wants()
    ),
    pytest.param(
        None,
        [SaveFirstStep()],
        [
            (37, 0.0, True, False),
            (37, 0.1, True, True),
            (38, 0.2, False, False),
            (0, 0.3, False, False),
        ],
        id="first-step-asked-twice",  # should_save(37) then save(37): both say yes
    ),
    pytest.param(
        None,
        [SaveAtSteps(frozenset({7})), SaveEveryNSteps(5)],
        [(5, 0.0, True, True), (6, 0.0, False, False), (7, 0.0, True, True), (10, 0.0, True, True)],
        id="any-of-two",
    ),
    pytest.param(
        10,
        [SaveFirstStep(), SaveEveryNSeconds(60)],
        [
            (3, 1.0, True, True),  # first step
            (4, 30.0, False, False),
            (10, 31.0, True, True),  # interval
            (11, 90.0, False, False),  # 59 s after the save at 31 s
            (12, 91.0, True, True),  # 60 s after it
        ],
        id="interval-plus-policies",
    ),
    pytest.param(None, [], [(0, 0.0, False, False), (10, 1e9, False, False)], id="no-policies"),
    pytest.param(
        None,
        [SaveEveryNSeconds(60)],
        [(1, -500.0, False, False), (2, 59.0, False, False), (3, 60.0, True, True)],
        id="clock-before-creation",
    ),
]


@pytest.mark.parametrize(("save_interval", "policies", "timeline"), SCHEDULE_CASES)
def test_schedule(
    save_interval: int | None, policies: list[SavePolicy], timeline: Timeline
) -> None:
    schedule = schedule_from(save_interval, policies, created_at=0.0)
    for step, now, wanted, start in timeline:
        assert schedule.wants(step, now) is wanted, (step, now)
        if start:
            schedule.started(step, now)
            assert (schedule.last_save_step, schedule.last_save_at) == (step, now)


def test_schedule_from_builds_the_policy_list() -> None:
    first = SaveFirstStep()
    schedule = schedule_from(500, (p for p in [first, SaveAtPowersOfTwo()]), created_at=12.5)
    assert isinstance(schedule, SaveSchedule)
    assert schedule.policies[0] == SaveEveryNSteps(500)
    assert schedule.policies[1] is first
    assert isinstance(schedule.policies[2], SaveAtPowersOfTwo)
    assert len(schedule.policies) == 3
    assert schedule.created_at == 12.5
    assert (schedule.first_step, schedule.last_save_step, schedule.last_save_at) == (None,) * 3
    assert schedule_from(None, [], created_at=0.0).policies == []


def test_schedule_gives_policies_the_context() -> None:
    recording = Recording()
    schedule = schedule_from(None, [recording], created_at=100.0)
    schedule.wants(40, 130.0)
    schedule.wants(41, 150.0)
    schedule.started(41, 150.0)
    schedule.wants(42, 155.5)
    schedule.wants(39, 90.0)  # a clock that went back: never negative
    assert recording.seen == [
        SaveContext(40, 40, None, 30.0),
        SaveContext(41, 40, None, 50.0),
        SaveContext(42, 40, 41, 5.5),
        SaveContext(39, 40, 41, 0.0),
    ]
    assert schedule.first_step == 40


def test_user_policy_in_a_schedule_sees_its_own_saves() -> None:
    schedule = schedule_from(None, [SaveWhenStepsSinceLastSave(3)], created_at=0.0)
    saved = []
    for step in range(10):
        if schedule.wants(step, float(step)):
            schedule.started(step, float(step))
            saved.append(step)
    assert saved == [0, 3, 6, 9]


def test_every_policy_is_asked_about_every_step() -> None:
    """BUG (fails): ``SaveSchedule.wants`` stops at the first policy that says yes.

    The module promises that "the manager asks every policy at each step"; a stateful user
    policy (one that counts steps, or tracks a running statistic) after a policy that said yes
    never sees that step.
    """
    recording = Recording()
    schedule = schedule_from(2, [recording], created_at=0.0)
    for step in range(6):
        schedule.wants(step, 0.0)
    assert [context.step for context in recording.seen] == [0, 1, 2, 3, 4, 5]


@settings(max_examples=200, deadline=None)
@given(
    seconds=st.floats(min_value=0.001, max_value=1e4, allow_nan=False),
    created_at=st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    gaps=st.lists(st.floats(min_value=0.0, max_value=5e3, allow_nan=False), max_size=60),
)
def test_every_n_seconds_saves_exactly_when_the_time_has_passed(
    seconds: float, created_at: float, gaps: list[float]
) -> None:
    schedule = schedule_from(None, [SaveEveryNSeconds(seconds)], created_at=created_at)
    now = created_at
    clock_from = created_at
    starts: list[float] = []
    for step, gap in enumerate(gaps):
        now += gap
        wanted = schedule.wants(step, now)
        assert wanted == (now - clock_from >= seconds)
        if wanted:
            schedule.started(step, now)
            clock_from = now
            starts.append(now)
    assert all(later - earlier >= seconds for earlier, later in itertools.pairwise(starts))


STEP_POLICIES: st.SearchStrategy[SavePolicy] = st.one_of(
    st.builds(SaveEveryNSteps, st.integers(1, 50)),
    st.builds(SaveAtSteps, st.frozensets(st.integers(0, 200), max_size=10)),
    st.just(SaveFirstStep()),
    st.just(SaveAtPowersOfTwo()),
)


@settings(max_examples=200, deadline=None)
@given(
    save_interval=st.none() | st.integers(1, 50),
    policies=st.lists(STEP_POLICIES, max_size=4),
    steps=st.lists(st.integers(0, 200), min_size=1, max_size=30),
)
def test_schedule_wants_a_step_iff_the_interval_or_any_policy_does(
    save_interval: int | None, policies: list[SavePolicy], steps: list[int]
) -> None:
    schedule = schedule_from(save_interval, policies, created_at=0.0)
    for index, step in enumerate(steps):
        context = SaveContext(step, steps[0], None, float(index))
        expected = (save_interval is not None and step % save_interval == 0) or any(
            policy.should_save(context) for policy in policies
        )
        assert schedule.wants(step, float(index)) == expected


# -- parsing from configuration mappings -----------------------------------------------------------
PARSE_CASES = [
    pytest.param({"type": "save_every_n_steps", "n": 500}, SaveEveryNSteps(500), id="every-n"),
    pytest.param(
        {"type": "save_every_n_seconds", "seconds": 1800},
        SaveEveryNSeconds(1800.0),
        id="every-seconds-int",
    ),
    pytest.param(
        {"type": "save_every_n_seconds", "seconds": 0.5},
        SaveEveryNSeconds(0.5),
        id="every-seconds-float",
    ),
    pytest.param(
        {"type": "save_at_steps", "steps": [1, 10, 10]},
        SaveAtSteps(frozenset({1, 10})),
        id="at-steps",
    ),
    pytest.param({"type": "save_at_steps", "steps": []}, SaveAtSteps(frozenset()), id="at-none"),
    pytest.param({"type": "save_first_step"}, SaveFirstStep(), id="first-step"),
    pytest.param(
        MappingProxyType({"type": "save_every_n_steps", "n": 3}),
        SaveEveryNSteps(3),
        id="any-mapping",
    ),
]


@pytest.mark.parametrize(("spec", "expected"), PARSE_CASES)
def test_parse_save_policy(spec: Mapping[str, Any], expected: SavePolicy) -> None:
    parsed = parse_save_policy(spec)
    assert parsed == expected
    assert type(parsed) is type(expected)
    for context in (ctx(10, first_step=1, since=1800.0), ctx(1, first_step=1), ctx(3)):
        assert parsed.should_save(context) == expected.should_save(context)


BAD_SPECS = [
    pytest.param({"type": "save_every_n_minutes", "minutes": 5}, id="unknown-type"),
    pytest.param({"type": "keep_latest", "n": 3}, id="retention-type"),
    pytest.param({"n": 5}, id="no-type"),
    pytest.param({}, id="empty"),
    pytest.param({"type": "save_every_n_steps"}, id="steps-no-n"),
    pytest.param({"type": "save_every_n_steps", "n": 0}, id="steps-n=0"),
    pytest.param({"type": "save_every_n_steps", "n": -5}, id="steps-n=-5"),
    pytest.param({"type": "save_every_n_steps", "n": True}, id="steps-n=True"),
    pytest.param({"type": "save_every_n_steps", "n": "5"}, id="steps-n='5'"),
    pytest.param({"type": "save_every_n_steps", "n": 1.5}, id="steps-n=1.5"),
    pytest.param({"type": "save_every_n_seconds"}, id="seconds-missing"),
    pytest.param({"type": "save_every_n_seconds", "seconds": 0}, id="seconds=0"),
    pytest.param({"type": "save_every_n_seconds", "seconds": -1800}, id="seconds=-1800"),
    pytest.param({"type": "save_every_n_seconds", "seconds": math.nan}, id="seconds=nan"),
    pytest.param({"type": "save_every_n_seconds", "seconds": math.inf}, id="seconds=inf"),
    pytest.param({"type": "save_every_n_seconds", "seconds": "soon"}, id="seconds=str"),
    pytest.param({"type": "save_at_steps"}, id="at-missing"),
    pytest.param({"type": "save_at_steps", "steps": [-1]}, id="at-negative"),
    pytest.param({"type": "save_at_steps", "steps": [False]}, id="at-bool"),
    pytest.param({"type": "save_at_steps", "steps": 10}, id="at-not-a-list"),
]


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_parse_save_policy_rejects_bad_values(spec: Mapping[str, Any]) -> None:
    with pytest.raises(ValidationError) as raised:
        parse_save_policy(spec)
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param({"type": "save_every_n_steps", "n": 5, "every": 10}, id="unknown-key"),
        pytest.param({"type": "save_every_n_seconds", "second": 60, "seconds": 1}, id="typo-key"),
        pytest.param({"type": "save_first_step", "n": 1}, id="first-step-with-n"),
        pytest.param({"type": "save_every_n_seconds", "seconds": True}, id="seconds=True"),
    ],
)
def test_parse_save_policy_rejects_unknown_keys_and_bool_seconds(spec: Mapping[str, Any]) -> None:
    """BUG (fails): unknown keys are silently dropped and ``seconds=True`` is read as 1.0."""
    with pytest.raises(ValidationError):
        parse_save_policy(spec)


@pytest.mark.parametrize(
    ("construct", "field"),
    [
        pytest.param(lambda: SaveEveryNSteps(0), "n", id="SaveEveryNSteps(0)"),
        pytest.param(lambda: SaveEveryNSteps(False), "n", id="SaveEveryNSteps(False)"),
        pytest.param(lambda: SaveEveryNSeconds(0.0), "seconds", id="SaveEveryNSeconds(0)"),
        pytest.param(lambda: SaveEveryNSeconds(-1.0), "seconds", id="SaveEveryNSeconds(-1)"),
        pytest.param(lambda: SaveAtSteps(frozenset({-2})), "steps", id="SaveAtSteps(-2)"),
    ],
)
def test_constructors_validate_and_name_the_field(construct: Any, field: str) -> None:
    # A positional argument was named by its position ("0") in pydantic's error.
    with pytest.raises(ValidationError) as raised:
        construct()
    assert raised.value.errors()[0]["loc"][0] == field


def test_parse_save_policy_passes_objects_through() -> None:
    builtin = SaveEveryNSeconds(60)
    user = SaveAtPowersOfTwo()
    assert parse_save_policy(builtin) is builtin
    assert parse_save_policy(user) is user


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(5, id="int"),
        pytest.param("save_first_step", id="str"),
        pytest.param(None, id="None"),
        pytest.param(object(), id="object"),
        pytest.param(KeepLatest(3), id="retention-policy"),
    ],
)
def test_parse_save_policy_rejects_non_policies(value: Any) -> None:
    with pytest.raises(ValueError, match="save policy must be"):
        parse_save_policy(value)


# -- the configuration forms -----------------------------------------------------------------------
def test_config_parses_save_and_retention_policies(tmp_path: Path) -> None:
    user = SaveAtPowersOfTwo()
    config = CheckpointConfig(
        path=str(tmp_path / "ckpts"),
        save_interval=None,
        save_policy=[{"type": "save_every_n_seconds", "seconds": 1800}, SaveFirstStep(), user],
        retention=[{"type": "keep_latest", "n": 3}, KeepEveryNSteps(1000)],
    )
    assert config.save_interval is None
    assert config.save_policy == [SaveEveryNSeconds(1800.0), SaveFirstStep(), user]
    assert config.retention == [KeepLatest(3), KeepEveryNSteps(1000)]
    one = CheckpointConfig(path="x", save_policy={"type": "save_first_step"})
    assert one.save_policy == [SaveFirstStep()]


def test_config_file_form(tmp_path: Path) -> None:
    file = tmp_path / "ckpt.yaml"
    file.write_text(
        "path: checkpoints/run\n"
        "retention:\n"
        "  - {type: keep_latest, n: 3}\n"
        "  - {type: keep_every_n_steps, n: 1000}\n"
        "save_policy:\n"
        "  - {type: save_every_n_seconds, seconds: 1800}\n"
        "  - type: save_at_steps\n"
        "    steps: [10, 20]\n",
        encoding="utf-8",
    )
    config = CheckpointConfig.from_file(file)
    assert config.retention == [KeepLatest(3), KeepEveryNSteps(1000)]
    assert config.save_policy == [SaveEveryNSeconds(1800.0), SaveAtSteps(frozenset({10, 20}))]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        pytest.param({}, "save_interval", id="neither-interval-nor-policy"),
        pytest.param({"save_policy": []}, "save_interval", id="empty-policy-list"),
        pytest.param(
            {"save_policy": [{"type": "save_every_n_steps", "n": 0}]}, "greater than 0", id="bad-n"
        ),
        pytest.param({"save_policy": ["hourly"]}, "save policy must be", id="not-a-policy"),
    ],
)
def test_config_rejects_bad_save_policies(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CheckpointConfig(path="x", **overrides)
