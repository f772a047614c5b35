"""A job that stops at a step boundary writes one consistent checkpoint, and a run resumed
from it ends bitwise equal to a run that never stopped.

- no spare left after the pause timeout: rank 1 is killed in step 3 with no spare; rank 0
  writes the checkpoint of boundary 3 (its replica state, its own rank state, rank 1's from
  its mirror); the resumed run redoes step 3 (one step lost) and finishes equal;
- the launchers of a two-node job stopped by SIGTERM: the ranks agree on a boundary, write
  it and exit; the launchers exit 130; the resumed run loses no step and finishes equal.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from migrator import checkpoint
from migrator.faults import FaultPlan
from tests.migrator.harness import Outcome, Run, assert_same_final, launch, reference
from tests.migrator.nodes_harness import launch_nodes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 8


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    return reference(tmp_path_factory, steps=STEPS, mode="plain")


def assert_resumed_equal(base: Outcome, stopped: Path, resumed: Run, *, at: int) -> None:
    """The stopped run's rows (steps before ``at``) and the resumed run's (from ``at``) are
    the base run's, row for row; final parameters and optimizer state ``torch.equal``."""
    first = Outcome(stopped).steps()
    assert {step for _, step in first} == set(range(at)), sorted(first)
    second = resumed.steps()
    assert {step for _, step in second} == set(range(at, STEPS)), sorted(second)
    rows = base.steps()
    assert set(first) | set(second) == set(rows)
    for key, row in {**first, **second}.items():
        assert (row["loss"], row["samples"]) == (rows[key]["loss"], rows[key]["samples"]), key
    assert_same_final(base, resumed, nproc=2)


def test_no_spare_left_stops_with_a_checkpoint_and_resumes_bitwise_equal(
    base: Outcome, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    plan = FaultPlan().fail_at(1, 3)
    stopped = launch(
        tmp_path / "stopped",
        spares=0,
        plan=plan,
        steps=STEPS,
        mode="plain",
        timeout_s=5.0,
        pause_timeout_s=0.5,
        checkpoint_dir=ckpt,
    )
    assert stopped.code == 1
    msg = stopped.agent.message
    assert "paused at step 3" in msg and "no spare came" in msg, msg
    assert f"checkpoint of step 3 in {ckpt}" in msg, msg
    payload = checkpoint.load(ckpt)
    assert (payload["step"], payload["info"]["lost"]) == (3, [1])
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000003.pt"]
    resumed = launch(tmp_path / "resumed", spares=0, steps=STEPS, mode="plain", resume_from=ckpt)
    assert resumed.code == 0, resumed.agent.message
    assert_resumed_equal(base, tmp_path / "stopped", resumed, at=3)


def test_sigterm_stops_at_a_boundary_with_a_checkpoint_and_resumes_bitwise_equal(
    base: Outcome, tmp_path: Path
) -> None:
    """Two launchers (rank 0 on node 0; rank 1 and a spare on node 1), both sent SIGTERM at
    once, as a scheduler stops a job: node 1's launcher asks the coordinator to stop and keeps
    its ranks up; the ranks agree on a boundary and write it; both launchers exit 130."""
    out, ckpt = tmp_path / "stopped", tmp_path / "ckpt"

    def stop_once_training(launchers: list[subprocess.Popen[str]]) -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not any(out.glob("log.slot*.jsonl")):
            time.sleep(0.1)
        for launcher in launchers:
            launcher.terminate()

    run, errs = launch_nodes(
        out,
        [(1, 0), (1, 1)],
        steps=STEPS,
        extra=("--checkpoint-dir", str(ckpt)),
        script_args=("--step-sleep", "0.4"),
        during=stop_once_training,
    )
    assert run.agent.codes == [130, 130], errs
    assert "job job stopped" in errs[0] and "checkpoint of step" in errs[0], errs[0]
    payload = checkpoint.load(ckpt)
    at = payload["step"]
    assert 0 < at < STEPS and payload["info"]["lost"] == []
    for log in (out / "logs").glob("slot*.log"):
        assert "Traceback" not in log.read_text(), log.read_text()
    resumed = launch(tmp_path / "resumed", spares=0, steps=STEPS, mode="plain", resume_from=ckpt)
    assert resumed.code == 0, resumed.agent.message
    assert_resumed_equal(base, out, resumed, at=at)
