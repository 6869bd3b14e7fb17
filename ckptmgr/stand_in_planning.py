"""A DCP planner's local plan made with stand-ins in its state (:mod:`ckptmgr.write_items`,
:mod:`ckptmgr.load_chunks`): objects of DCP's checkpointable protocol that give DCP's planning
what it would otherwise work out per DTensor. Each counts how often DCP asked it (``calls``);
a planning that raised, or did not ask each stand-in exactly once (a torch that plans
otherwise), is made again from the planner's own state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol


class StandIn(Protocol):
    """A stand-in of a DTensor in a planner's state."""

    calls: int


def plan_with_stand_ins(
    planner: Any,
    planned: dict[str, Any],
    used: Sequence[StandIn],
    make_plan: Callable[[], Any],
    on_refused: Callable[[], None] | None = None,
) -> Any:
    """``make_plan()`` (the planner's own ``create_local_plan``) with ``planner.state_dict``
    replaced by ``planned`` while it runs; where it raised or did not ask each of ``used`` once,
    ``make_plan()`` again on the planner's own state (an error of the state itself is raised
    from there), after which ``on_refused`` is called."""
    state_dict = planner.state_dict
    planner.state_dict = planned
    try:
        plan = make_plan()
    except Exception:
        plan = None
    finally:
        planner.state_dict = state_dict
    if plan is not None and all(stand_in.calls == 1 for stand_in in used):
        return plan
    plan = make_plan()
    if on_refused is not None:
        on_refused()
    return plan
