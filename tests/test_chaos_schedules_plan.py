"""The schedule explorer's planning (scripts/chaos_schedules.py), pure: no
daemon runs here (its runs are in tests/test_chaos_short.py)."""

from __future__ import annotations

from scripts.chaos_schedules import generate


def test_the_explorer_never_plans_one_point_twice() -> None:
    """A point fires once per run (`failpoints._first_firing`, so that a crash
    in a restart's recovery does not crash every restart): a second fault
    planned at the first's point would never fire."""
    for seed in range(50):
        for schedule in generate(seed, 60, None):
            points = [fault.point for fault in schedule.faults]
            assert len(points) == len(set(points)), schedule.reproduce()
