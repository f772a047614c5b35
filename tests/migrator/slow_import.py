"""A module slow to import in the fork server of node rank 1's launcher
(``FOREWARN_TEST_SLOW_IMPORT_S`` seconds; elsewhere at once): preloaded in
tests/migrator/test_nodes.py, it stands for a node whose imports take long."""

import os
import time
from pathlib import Path

launcher = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
if b"--node-rank" in launcher and launcher[launcher.index(b"--node-rank") + 1] == b"1":
    time.sleep(float(os.environ.get("FOREWARN_TEST_SLOW_IMPORT_S", "0")))
