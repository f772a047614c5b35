"""The NCCL path: generations are ProcessGroupNCCL, the state moves GPU to GPU with NCCL
send/recv. Needs two CUDA GPUs (a rank and its spare each hold one); skipped otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from migrator.faults import FaultPlan
from tests.migrator.harness import launch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs for a rank and its spare; {GPUS} here"),
]

NCCL_ENV = {
    "NCCL_ALGO": "Ring",
    "NCCL_PROTO": "Simple",
    "NCCL_MIN_NCHANNELS": "1",
    "NCCL_MAX_NCHANNELS": "1",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}


def test_preventive_move_gpu_to_gpu_is_bitwise_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in NCCL_ENV.items():
        monkeypatch.setenv(name, value)  # the processes the agent starts inherit them
    common = {"nproc": 1, "steps": 12, "backend": "nccl", "script_args": ("--cuda",)}
    base = launch(tmp_path / "base", spares=0, **common)
    assert base.code == 0, base.agent.message
    run = launch(tmp_path / "run", spares=1, plan=FaultPlan().migrate_at(0, 4), **common)
    assert run.code == 0, run.agent.message
    (report,) = run.reports
    assert (report.outcome, report.step, report.steps_lost) == ("completed", 5, 0)
    assert report.target and report.target.gpu == 1
    fb, fr = base.final(0), run.final(0)
    for name, t in fb["model"].items():
        assert torch.equal(t, fr["model"][name]), name
