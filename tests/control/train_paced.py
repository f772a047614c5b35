"""``tests/migrator/train_tiny.py`` with a pause after every step (``--pace-s``), so that a
job lives long enough for the control loop to act on it, until the file ``OUT/fast`` exists
(the test creates it once it has seen what it waits for). The pause touches no state: a paced
run ends with the same parameters as an unpaced one."""

from __future__ import annotations

import runpy
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from migrator import job as job_module

TINY = Path(__file__).resolve().parents[1] / "migrator" / "train_tiny.py"


def main() -> None:
    argv = sys.argv[1:]
    pace = 0.0
    if "--pace-s" in argv:
        at = argv.index("--pace-s")
        pace = float(argv[at + 1])
        del argv[at : at + 2]
    fast = Path(argv[argv.index("--out") + 1]) / "fast"
    steps = job_module.Job.steps

    def paced(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for step in steps(self, *args, **kwargs):
            yield step
            if not fast.exists():
                time.sleep(pace)

    job_module.Job.steps = paced  # type: ignore[method-assign]
    sys.argv = [str(TINY), *argv]
    runpy.run_path(str(TINY), run_name="__main__")


if __name__ == "__main__":
    main()
