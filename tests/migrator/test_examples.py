"""The cluster examples stay valid: the sbatch script parses, the Kubernetes manifests load
with the fields a rendezvous needs, and both call ``forewarn launch`` with flags it takes."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from migrator.launch_cli import configure

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser


def _launch_segment(text: str) -> str:
    """The ``forewarn launch`` command line in ``text``, up to its training command."""
    body = text[text.index("exec forewarn launch") + len("exec forewarn launch") :]
    return body[: body.index(" -- ")]


def _flags_known(segment: str) -> list[str]:
    known = set(_parser()._option_string_actions)
    flags = re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", segment)
    assert flags, "no flags found"
    return [f for f in flags if f not in known]


def test_sbatch_script_parses_and_starts_one_launcher_per_node() -> None:
    script = EXAMPLES / "slurm" / "train.sbatch"
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash on this machine")
    subprocess.run([bash, "-n", str(script)], check=True, timeout=30)
    text = script.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text and "srun" in text
    segment = _launch_segment(text)
    assert _flags_known(segment) == []
    for flag, value in [
        ("--nnodes", "$SLURM_NNODES"),
        ("--node-rank", "$SLURM_NODEID"),
        ("--backend", "nccl"),
        ("--service", "$FOREWARN_SERVICE"),
    ]:
        assert re.search(re.escape(flag) + r'\s+"?' + re.escape(value), segment), flag
    assert "--rdzv-endpoint" in segment and "RDZV_HOST" in segment


def test_kubernetes_manifests_have_what_a_rendezvous_needs() -> None:
    docs = list(yaml.safe_load_all((EXAMPLES / "kubernetes" / "train-job.yaml").read_text()))
    by_kind = {d["kind"]: d for d in docs}
    service, job = by_kind["Service"], by_kind["Job"]
    assert service["spec"]["clusterIP"] == "None"  # headless
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    (container,) = pod["containers"]
    line = " ".join(container["args"])
    assert _flags_known(_launch_segment(line)) == []
    args = _parser().parse_args(shlex.split(_launch_segment(line)))
    assert args.nnodes == spec["completions"]
    host, port = args.rdzv_endpoint.split(":")
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(port) == service["spec"]["ports"][0]["port"]
    assert args.node_rank is None  # from $JOB_COMPLETION_INDEX at run time
    env = {e["name"] for e in container["env"]}
    assert {"FOREWARN_TOKEN", "FOREWARN_SERVICE", "NODE_NAME"} <= env
