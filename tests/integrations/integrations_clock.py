"""What the integration tests' plans are timed by (not a conftest.py: tests/conftest.py is the
suite's, and test modules import it by that name)."""

from __future__ import annotations


class StillClock:
    """storm.plan's clock (storm.planner.Clock) standing still: every block and step takes no
    time, so when a plan settles depends on the steps run, never on how fast a loaded machine
    ran them (a trial between two plans is then a tie)."""

    first_calls_load = False

    def host(self) -> float:
        return 0.0

    def mark(self) -> float:
        return 0.0

    def elapsed_ms(self, start: float, end: float) -> float:
        return 0.0


# Steps a budget=0.5 plan of a tiny CPU model takes to settle on the still clock: two traces, then
# a trial of the two forms of recompute, tied on this clock, for its most steps.
SETTLE_STEPS = 20
