"""``forewarn demo`` (what ``make run`` starts) tells its story end to end with real processes:
a preventive migration off a wearing GPU with no step lost, an unplanned recovery of a rank
whose GPU died, and a final state equal, bit for bit, to a run that nothing disturbed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_demo_tells_the_whole_story(tmp_path: Path) -> None:
    port = free_port()
    summary_path = tmp_path / "summary.json"
    result = subprocess.run(
        [
            sys.executable, "-m", "forewarn", "demo", "--port", str(port),
            "--gpus", "64", "--steps", "500", "--data-dir", str(tmp_path / "var"),
            "--duration", "0", "--json", str(summary_path),
            # the fleet lived twice as fast as the default; the wear keeps the default 90 s,
            # which leaves the move about 12 s ahead of the failure (45 s left 4 s: too few
            # for a machine loaded by the rest of the suite)
            "--speed", "60", "--wear-lead-s", "90",
        ],
        capture_output=True,
        text=True,
        timeout=560,
    )  # fmt: skip
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
        for p in sorted((tmp_path / "var").glob("demo-*.log"))
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{logs}"
    assert f"dashboard   http://127.0.0.1:{port}/" in result.stdout
    summary = json.loads(summary_path.read_text())
    print(result.stdout, json.dumps(summary, indent=1))
    preventive, unplanned = summary["preventive"], summary["unplanned"]
    assert (preventive["trigger"], preventive["state"], preventive["rank"]) == (
        "preventive", "completed", 1,
    )  # fmt: skip
    assert preventive["steps_lost"] == 0 and preventive["bytes_moved"] > 0
    assert preventive["reasons"], "an alarm comes with its reasons"
    assert summary["lead_s"] > 0, "the rank left before the GPU failed"
    assert (unplanned["trigger"], unplanned["state"], unplanned["rank"]) == (
        "unplanned", "completed", 0,
    )  # fmt: skip
    assert unplanned["steps_lost"] <= 1
    assert summary["bitwise_equal"], summary["differences"]
    assert "bit for bit equal to the reference" in result.stdout
    # the demo's own receiver got the deliveries its migrations caused, signatures verified
    assert summary["webhooks"].get("migration.completed", 0) >= 2, summary["webhooks"]
    assert summary["webhooks"].get("migration.requested", 0) >= 1, summary["webhooks"]
    assert "deliveries verified by the demo's receiver" in result.stdout
    with pytest.raises(httpx.HTTPError):  # every part stopped with the demo
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
