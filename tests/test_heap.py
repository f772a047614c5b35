"""The control process keeps large blocks in its heap (forewarn.heap.keep_large_blocks)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_SECOND_BLOCK_FAULTS = """
import resource, sys
import numpy as np
from forewarn import heap
if sys.argv[1] == "keep":
    assert heap.keep_large_blocks()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
first = np.ones(100 << 17)  # 100 MiB, as a tick's read of 500,000 samples
del first
before = faults()
second = np.ones(100 << 17)
print(faults() - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _SECOND_BLOCK_FAULTS, mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_large_block_freed_is_handed_out_again_without_faulting_its_pages_in() -> None:
    plain, kept = _faults("plain"), _faults("keep")
    # By default a block this large is a mapping of its own, unmapped when freed: the next one
    # faults its pages in (and the kernel zero-fills them) again.
    assert plain > 0
    assert kept * 10 < plain, (kept, plain)
