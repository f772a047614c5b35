"""The next generation's group formed while training goes on (real processes, gloo).

A planned or preventive move forms g+1 (the spare at the source's rank) in a thread of each
process as soon as the command and the spare's assignment are known; at S the switch takes
the formed group. These tests check that the switch took it and the run stays bitwise equal,
that an aborted move leaves its formed group behind and a later move forms its own, and that
a source lost while g+1 forms turns into an unplanned recovery on a group built anew.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from migrator.faults import FaultPlan
from tests.migrator.harness import Outcome, assert_same, launch, reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    return reference(tmp_path_factory, nproc=3, steps=12, mode="plain")


def test_preventive_move_switches_to_the_group_formed_ahead(
    base: Outcome, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """3 ranks + 1 spare, rank 1 moved preventively at 4: every rank switches to the group
    formed ahead under the migration's prefix; the launcher's report says so and how long
    the rendezvous took; the stall runs from the source at S to the new rank joined."""
    plan = FaultPlan().migrate_at(1, 3, reason="preventive")
    report = tmp_path / "reports.jsonl"
    run = launch(tmp_path, nproc=3, spares=1, plan=plan, steps=12, mode="plain", report_path=report)
    assert_same(base, run, nproc=3)
    [rep] = run.reports
    assert (rep.rank, rep.outcome, rep.step, rep.steps_lost) == (1, "completed", 4, 0)
    group = run.agent.groups[rep.migration_id]
    assert group is not None and group["preformed"] and not group["abandoned"]
    assert sorted(group["ranks"]) == [0, 1, 2]  # the spare (at rank 1) and both survivors
    assert group["form_s"] is not None and group["form_s"] > 0
    assert isinstance(group["ready_at_switch"], bool) and group["waited_s"] >= 0
    # The stall includes the transfer: it is never shorter than the transfer itself.
    assert rep.pause_s is not None and rep.transfer_s is not None
    assert rep.pause_s >= rep.transfer_s
    [line] = [json.loads(x) for x in report.read_text().splitlines()]
    assert line["group"]["preformed"] is True
    assert "g+1 formed ahead" in capsys.readouterr().err


def test_aborted_move_abandons_its_formed_group_and_a_later_move_forms_its_own(
    base: Outcome, tmp_path: Path
) -> None:
    """The spare taking rank 0 at 4 dies mid-receive, after g+1 started forming: the move
    is aborted, the formation abandoned, training goes on on g; the move at 7 forms its own
    group (another prefix) and completes; bitwise equal."""
    plan = FaultPlan().migrate_at(0, 3).fail_at(0, 4, where="receive").migrate_at(0, 6)
    run = launch(tmp_path, nproc=3, spares=2, plan=plan, steps=12, mode="plain", timeout_s=5.0)
    assert_same(base, run, nproc=3)
    first, second = run.reports
    assert (first.outcome, first.step, second.outcome, second.step) == (
        "failed",
        4,
        "completed",
        7,
    )
    aborted = run.agent.groups[first.migration_id]
    assert aborted is not None and aborted["abandoned"] and not aborted["preformed"]
    # Both survivors said what became of their formation (formed or still forming).
    assert sorted(aborted["ranks"]) == [1, 2]
    done = run.agent.groups[second.migration_id]
    assert done is not None and done["preformed"] and not done["abandoned"]


def test_source_lost_while_the_next_group_forms_is_recovered_on_a_group_built_anew(
    base: Outcome, tmp_path: Path
) -> None:
    """Rank 0 asks to move itself at 3 and is SIGKILLed as it sees the command, while the
    spare and the survivors form g+1 for the move: the move becomes an unplanned recovery
    (the spare reused, the state from a replica), whose ranks build g+1 anew and abandon the
    formation; one step lost, bitwise equal."""
    plan = FaultPlan().migrate_at(0, 3).fail_at(0, 3, where="forming")
    run = launch(tmp_path, nproc=3, spares=1, plan=plan, steps=12, mode="plain", timeout_s=5.0)
    assert_same(base, run, nproc=3)
    [rep] = run.reports
    assert (rep.rank, rep.outcome, rep.step, rep.steps_lost) == (0, "completed", 3, 1)
    assert run.agent.groups[rep.migration_id] is None  # unplanned: no group formed ahead
