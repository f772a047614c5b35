"""``forewarn demo`` run again in the same checkout (``make run`` twice): the job directories
an earlier demo left (``logs/`` in them) are cleared, not tripped over.

Apart from :mod:`tests.demo.test_demo` (the story, minutes) so that the suite's workers run the
two side by side; the earlier run's directories are laid out here as the story leaves them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_second_demo_clears_what_the_first_left(tmp_path: Path) -> None:
    var = tmp_path / "var"
    for left in ("demo-job", "demo-reference"):  # what a story leaves: logs/, reports, a log
        (var / left / "logs").mkdir(parents=True)
        (var / left / "logs" / "rank0.log").write_text("an earlier run\n")
        (var / left / "reports.jsonl").write_text("{}\n")
        (var / left / "fast").touch()
    again = subprocess.run(
        [
            sys.executable, "-m", "forewarn", "demo", "--port", str(free_port()),
            "--gpus", "16", "--data-dir", str(var), "--no-story", "--duration", "1",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert again.returncode == 0, f"{again.stdout}\n{again.stderr}"
    assert "Traceback" not in again.stderr and "for 1 s" in again.stdout
    assert not (var / "demo-job" / "logs" / "rank0.log").exists()
