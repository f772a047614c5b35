"""The cluster examples stay valid and survive a node loss, checked here without a cluster.

- the sbatch script runs under bash with stand-ins for ``srun``, ``scontrol`` and
  ``forewarn`` (no Slurm here): the launcher command line it builds parses with the
  launcher's own parser, and the job and its step go on when a node fails (``--no-kill``);
- the Kubernetes manifests validate against a schema of the fields they use (the objects'
  field names and types, as in the Kubernetes API reference), the pod's command line runs
  under bash and parses with the same parser, the service port is the one ``deploy/``
  serves, a pod lost with its node fails its index alone, and the pods carry the
  determinism settings the sbatch script exports.
"""

from __future__ import annotations

import argparse
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from migrator.launch_cli import configure

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DEPLOY = ROOT / "deploy" / "kubernetes"
BASH = shutil.which("bash") or "bash"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")

# What a stand-in records: its arguments, one a line, then the environment it saw.
_RECORDER = """#!/bin/bash
{ printf '%s\\n' "$@"; echo '--env--'; env; } > "$RECORD_DIR/$(basename "$0").$$"
"""
_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$RECORD_DIR/srun.args"
while [[ "$1" == -* ]]; do shift; done
SLURM_NODEID=0 exec "$@"
"""
_SCONTROL = """#!/bin/bash
printf 'node-a\\nnode-b\\nnode-c\\nnode-d\\n'
"""


def _parse_launch(argv: list[str]) -> argparse.Namespace:
    """``forewarn ARGV`` through ``forewarn launch``'s own parser; fails on any error."""
    assert argv[:1] == ["launch"], argv
    parser = argparse.ArgumentParser(prog="forewarn launch", exit_on_error=False)
    configure(parser)
    try:
        return parser.parse_args(argv[1:])
    except (argparse.ArgumentError, SystemExit) as exc:
        pytest.fail(f"forewarn {' '.join(argv)}: {exc}")


def _bin(tmp: Path) -> Path:
    bindir = tmp / "bin"
    bindir.mkdir()
    for name, text in [("forewarn", _RECORDER), ("srun", _SRUN), ("scontrol", _SCONTROL)]:
        path = bindir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bindir


def _recorded(tmp: Path) -> tuple[list[str], dict[str, str]]:
    (record,) = list(tmp.glob("forewarn.*"))
    args, _, env = record.read_text().partition("--env--\n")
    pairs = (line.split("=", 1) for line in env.splitlines() if "=" in line)
    return args.splitlines(), dict(pairs)


def _run_sbatch(tmp: Path) -> tuple[list[str], dict[str, str], list[str]]:
    env = {
        "PATH": f"{_bin(tmp)}:/usr/bin:/bin",
        "RECORD_DIR": str(tmp),
        "SLURM_JOB_NODELIST": "node-[a-d]",
        "SLURM_NNODES": "4",
        "SLURM_JOB_NAME": "gpt-forewarn",
        "SLURM_JOB_ID": "42",
        "FOREWARN_SERVICE": "http://forewarn.example:8765",
        "FOREWARN_TOKEN": "t" * 20,
    }
    script = EXAMPLES / "slurm" / "train.sbatch"
    subprocess.run([BASH, str(script)], env=env, cwd=tmp, check=True, timeout=60)
    args, seen = _recorded(tmp)
    return args, seen, (tmp / "srun.args").read_text().splitlines()


def _determinism(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(("NCCL_", "CUBLAS_"))}


def test_sbatch_script_starts_launchers_that_outlive_a_node(tmp_path: Path) -> None:
    args, env, srun = _run_sbatch(tmp_path)
    launch = _parse_launch(args)
    assert (launch.nnodes, launch.node_rank, launch.nproc, launch.spares) == (4, 0, 7, 1)
    assert launch.rdzv_endpoint == "node-a:29400" and launch.backend == "nccl"
    assert launch.service == "http://forewarn.example:8765"
    assert launch.job_id == "gpt-forewarn-42"
    assert launch.command[:2] == ["--", "python"]
    # A node failure ends neither the allocation nor the step of the other launchers.
    directives = [
        line.split()[1]
        for line in (EXAMPLES / "slurm" / "train.sbatch").read_text().splitlines()
        if line.startswith("#SBATCH ")
    ]
    assert "--no-kill" in directives and "--ntasks-per-node=1" in directives
    assert "--no-kill" in srun and "--kill-on-bad-exit=0" in srun
    assert _determinism(env) == {
        "NCCL_ALGO": "Ring",
        "NCCL_PROTO": "Simple",
        "NCCL_MIN_NCHANNELS": "4",
        "NCCL_MAX_NCHANNELS": "4",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }


# -- Kubernetes -------------------------------------------------------------------------------


def _obj(required: tuple[str, ...] = (), **props: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(required),
        "additionalProperties": False,
    }


_STR, _INT, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_QUANTITIES = {"type": "object", "additionalProperties": {"type": ["string", "integer"]}}
_META = _obj(("name",), name=_STR, namespace=_STR, labels=_MAP, annotations=_MAP)
_ENV = _obj(
    ("name",),
    name=_STR,
    value=_STR,
    valueFrom=_obj(
        fieldRef=_obj(("fieldPath",), fieldPath=_STR),
        secretKeyRef=_obj(("name", "key"), name=_STR, key=_STR),
    ),
)
_CONTAINER = _obj(
    ("name", "image"),
    name=_STR,
    image=_STR,
    command={"type": "array", "items": _STR},
    args={"type": "array", "items": _STR},
    env={"type": "array", "items": _ENV},
    ports={
        "type": "array",
        "items": _obj(("containerPort",), name=_STR, containerPort=_INT, protocol=_STR),
    },
    resources=_obj(limits=_QUANTITIES, requests=_QUANTITIES),
)
_RULE = _obj(
    ("action",),
    action={"enum": ["FailJob", "FailIndex", "Ignore", "Count"]},
    onPodConditions={
        "type": "array",
        "items": _obj(("type",), type=_STR, status={"enum": ["True", "False", "Unknown"]}),
    },
    onExitCodes=_obj(
        ("operator", "values"),
        containerName=_STR,
        operator={"enum": ["In", "NotIn"]},
        values={"type": "array", "items": _INT},
    ),
)
# batch/v1 Job and v1 Service: the fields the example uses, named and typed as in the API
# reference (a misspelt or misplaced field fails: additionalProperties is false).
SCHEMAS: dict[str, dict[str, Any]] = {
    "Job": _obj(
        ("apiVersion", "kind", "metadata", "spec"),
        apiVersion={"const": "batch/v1"},
        kind={"const": "Job"},
        metadata=_META,
        spec=_obj(
            ("template",),
            completionMode={"enum": ["NonIndexed", "Indexed"]},
            completions=_INT,
            parallelism=_INT,
            backoffLimit=_INT,
            backoffLimitPerIndex=_INT,
            maxFailedIndexes=_INT,
            podFailurePolicy=_obj(("rules",), rules={"type": "array", "items": _RULE}),
            successPolicy=_obj(
                ("rules",),
                rules={
                    "type": "array",
                    "items": _obj(succeededIndexes=_STR, succeededCount=_INT),
                },
            ),
            template=_obj(
                ("spec",),
                metadata=_obj(labels=_MAP, annotations=_MAP),
                spec=_obj(
                    ("containers",),
                    subdomain=_STR,
                    hostname=_STR,
                    restartPolicy={"enum": ["Always", "OnFailure", "Never"]},
                    containers={"type": "array", "items": _CONTAINER, "minItems": 1},
                ),
            ),
        ),
    ),
    "Service": _obj(
        ("apiVersion", "kind", "metadata", "spec"),
        apiVersion={"const": "v1"},
        kind={"const": "Service"},
        metadata=_META,
        spec=_obj(
            clusterIP=_STR,
            publishNotReadyAddresses=_BOOL,
            selector=_MAP,
            ports={
                "type": "array",
                "items": _obj(("port",), name=_STR, port=_INT, targetPort={}, protocol=_STR),
            },
        ),
    ),
}


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all((EXAMPLES / "kubernetes" / "train-job.yaml").read_text()))
    return {d["kind"]: d for d in docs}


def test_kubernetes_manifests_match_the_api_schema(manifests: dict[str, dict[str, Any]]) -> None:
    assert set(manifests) == {"Job", "Service"}
    for kind, doc in manifests.items():
        jsonschema.validate(doc, SCHEMAS[kind])
    broken = dict(manifests["Job"], spec={**manifests["Job"]["spec"], "backofLimit": 0})
    with pytest.raises(jsonschema.ValidationError):  # the schema does catch a typo
        jsonschema.validate(broken, SCHEMAS["Job"])


def test_a_pod_lost_with_its_node_fails_its_index_alone(
    manifests: dict[str, dict[str, Any]],
) -> None:
    spec = manifests["Job"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    # Not backoffLimit: 0, which fails the whole Job (and its surviving pods) at one loss.
    assert "backoffLimit" not in spec and spec["backoffLimitPerIndex"] == 0
    assert spec["maxFailedIndexes"] == spec["completions"] - 1
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "FailIndex", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules
    assert all(r["action"] != "FailJob" for r in rules)
    assert spec["successPolicy"]["rules"] == [{"succeededIndexes": "0"}]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it


def test_kubernetes_pod_command_parses_and_reaches_the_deployed_service(
    manifests: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    job, service = manifests["Job"], manifests["Service"]
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"  # headless
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    (container,) = pod["containers"]
    env = {"PATH": f"{_bin(tmp_path)}:/usr/bin:/bin", "RECORD_DIR": str(tmp_path)}
    env["JOB_COMPLETION_INDEX"] = "0"
    for var in container["env"]:
        env[var["name"]] = var.get("value", f"{var['name'].lower()}-from-the-cluster")
    subprocess.run([*container["command"], *container["args"]], env=env, check=True, timeout=60)
    argv, seen = _recorded(tmp_path)
    launch = _parse_launch(argv)
    assert launch.nnodes == job["spec"]["completions"]
    host, port = launch.rdzv_endpoint.split(":")
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(port) == service["spec"]["ports"][0]["port"]
    assert launch.node_rank is None  # from $JOB_COMPLETION_INDEX at run time
    assert launch.token is None and seen["FOREWARN_TOKEN"]  # the secret, via the environment
    # The service URL names the Service deploy/kubernetes/service.yaml defines, on its port.
    deployed = [
        d
        for d in yaml.safe_load_all((DEPLOY / "service.yaml").read_text())
        if d and d["kind"] == "Service"
    ]
    urls = {
        f"http://{d['metadata']['name']}.{d['metadata']['namespace']}.svc:{p['port']}"
        for d in deployed
        for p in d["spec"]["ports"]
    }
    assert launch.service in urls, (launch.service, urls)


def test_kubernetes_pods_get_the_determinism_settings_of_the_sbatch_script(
    manifests: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    _, slurm_env, _ = _run_sbatch(tmp_path)
    (container,) = manifests["Job"]["spec"]["template"]["spec"]["containers"]
    pod_env = {v["name"]: v["value"] for v in container["env"] if "value" in v}
    assert _determinism(pod_env) == _determinism(slurm_env) != {}
