"""Goodput: how much training time a cluster keeps through failures, three ways.

``forewarn goodput`` simulates a long training job under failures drawn from the fleet
model (``sim``) or replayed from the real StepFun fault trace, and compares
checkpoint-restart, peer-replica recovery without prediction, and Forewarn (predicted
failures moved away by a preventive migration, the rest recovered from a replica), with a
straggler term beside the failures (``stragglers.py``: a what-if, no rate was published). See
``docs/goodput.md``.

This room may import the fleet model (``sim``) and numpy; matplotlib only to draw the PNG.
Never the service, the store or torch.
"""

from goodput.compare import Row, Scenario, compare
from goodput.model import STRATEGIES, Assumptions, Outcome, simulate
from goodput.profile import PredictorProfile, from_card
from goodput.published import run_sanity_check
from goodput.schedule import Failure, fleet_schedule, trace_schedule
from goodput.stragglers import Stragglers

__all__ = [
    "STRATEGIES",
    "Assumptions",
    "Failure",
    "Outcome",
    "PredictorProfile",
    "Row",
    "Scenario",
    "Stragglers",
    "compare",
    "fleet_schedule",
    "from_card",
    "run_sanity_check",
    "simulate",
    "trace_schedule",
]
