"""The deployment files hold together, checked by hand since no container engine runs here.

- ``Dockerfile``: copies every package the wheel is built from, installs extras that exist,
  and its default command is a valid ``forewarn`` command line;
- ``docker-compose.yml``: PostgreSQL, two service replicas, a simulated collector and the demo
  job; every command parses with the ``forewarn`` subcommand it names, every dependency and
  volume is declared, every ``FOREWARN_*`` variable is one the command reads;
- ``deploy/kubernetes/``: every object has its required fields, selectors match their pods,
  probes and ports name what exists, secrets referenced are defined, arguments parse.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from forewarn.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _parser(command: str) -> argparse.ArgumentParser:
    module = importlib.import_module(COMMANDS[command].module)
    parser = argparse.ArgumentParser(prog=f"forewarn {command}", exit_on_error=False)
    module.configure(parser)
    return parser


def parse_forewarn(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """Parse ``forewarn ARGV`` as the CLI would; fail the test on any error."""
    assert argv, "empty command"
    assert argv[0] in COMMANDS, f"{argv[0]!r} is not a forewarn command ({sorted(COMMANDS)})"
    try:
        return argv[0], _parser(argv[0]).parse_args(argv[1:])
    except (argparse.ArgumentError, SystemExit) as exc:
        pytest.fail(f"forewarn {' '.join(argv)}: {exc}")


def env_names_read_by(command: str) -> set[str]:
    """FOREWARN_* variables a command reads: the service's settings, or those its help names."""
    if command == "serve":
        from api.settings import Settings

        return {f"FOREWARN_{name.upper()}" for name in Settings.model_fields}
    return set(re.findall(r"FOREWARN_[A-Z_]+", _parser(command).format_help()))


def _interpolate(text: str) -> str:
    """Compose's ${VAR}, ${VAR:?message} and ${VAR:-default}, with a 20-character stand-in."""
    return re.sub(r"\$\{([A-Z_]+)(?::[?-][^}]*)?\}", lambda m: f"{m.group(1).lower():x<20}", text)


# -- Dockerfile -------------------------------------------------------------------------------


def _dockerfile() -> list[str]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and line[0] != "#"]


def test_dockerfile_builds_the_wheel_from_every_package() -> None:
    lines = _dockerfile()
    copies = [line.split()[1:] for line in lines if line.startswith("COPY ")]
    assert [".", "."] in copies  # the wheel stage takes the tree, less .dockerignore
    assert ["examples/", "examples/"] in copies
    ignored = [
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    needed = [p.rstrip("*") for p in include] + [
        "pyproject.toml",
        "README.md",
        "examples",
    ]
    for name in needed:
        hidden = [pattern for pattern in ignored if fnmatch.fnmatch(name, pattern)]
        assert not hidden, f".dockerignore hides {name} ({hidden}), which the image needs"


def test_dockerfile_extras_exist_and_default_command_parses() -> None:
    lines = _dockerfile()
    (extras,) = [line.split("=", 1)[1] for line in lines if line.startswith("ARG EXTRAS=")]
    known = set(PYPROJECT["project"]["optional-dependencies"])
    assert set(extras.split(",")) <= known
    assert 'ENTRYPOINT ["forewarn"]' in lines
    (cmd,) = [line for line in lines if line.startswith("CMD ")]
    import json

    command, args = parse_forewarn(json.loads(cmd.removeprefix("CMD ")))
    assert command == "serve" and args.host == "0.0.0.0"


# -- docker-compose.yml ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(_interpolate((ROOT / "docker-compose.yml").read_text()))


def test_compose_has_the_promised_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["db"]["image"].startswith("postgres:")
    by_command: dict[str, list[str]] = {}
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        if svc.get("image", "").startswith("forewarn"):
            by_command.setdefault(svc["command"][0], []).append(name)
    assert len(by_command["serve"]) == 2  # two replicas
    assert by_command["collect"] and by_command["launch"]
    collector = services[by_command["collect"][0]]["command"]
    assert collector[collector.index("--source") + 1] == "simulated"
    for name in by_command["serve"]:
        env = services[name]["environment"]
        assert env["FOREWARN_DATABASE_URL"].startswith("postgresql")
        assert "@db:" in env["FOREWARN_DATABASE_URL"]


def test_compose_commands_parse_and_read_their_variables(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        if not svc.get("image", "").startswith("forewarn"):
            continue
        command, args = parse_forewarn(list(svc["command"]))
        for var in svc.get("environment", {}):
            if var.startswith("FOREWARN_"):
                assert var in env_names_read_by(command), f"{name}: {command} never reads {var}"
        if command == "launch":
            assert args.command[1:2] == ["python"] or args.command[:1] == ["python"]
            script = next(a for a in args.command if a.endswith(".py"))
            assert (ROOT / script).is_file(), script
        if command == "serve":  # the service accepts this environment as production
            from api.settings import Settings

            with pytest.MonkeyPatch.context() as mp:
                for var, value in svc["environment"].items():
                    mp.setenv(var, str(value))
                settings = Settings()
            assert settings.token_scopes()  # tokens parse, production accepts them


def test_compose_references_are_declared(compose: dict[str, Any]) -> None:
    services, volumes = compose["services"], set(compose.get("volumes", {}))
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown {dep}"
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            assert source.startswith((".", "/")) or source in volumes, f"{name}: volume {source}"
        for port in svc.get("ports", []):
            assert re.fullmatch(r"\d+:\d+", port), port
    urls = re.findall(r"http://([a-z0-9-]+):", (ROOT / "docker-compose.yml").read_text())
    assert set(urls) <= set(services) | {"localhost", "127"}


# -- Kubernetes --------------------------------------------------------------------------------


def _k8s_objects() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def _pod_templates() -> list[tuple[str, dict[str, Any]]]:
    return [(f, d) for f, d in _k8s_objects() if d["kind"] in ("Deployment", "DaemonSet")]


def test_every_object_has_its_required_fields() -> None:
    objects = _k8s_objects()
    kinds = {d["kind"] for _, d in objects}
    assert {"Namespace", "Secret", "Deployment", "Service", "DaemonSet"} <= kinds
    for file, doc in objects:
        assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"].get("name"), file
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "forewarn", (file, doc["kind"])


def test_workloads_select_their_pods_and_their_commands_parse() -> None:
    secrets = {
        d["metadata"]["name"]: set(d["stringData"])
        for _, d in _k8s_objects()
        if d["kind"] == "Secret"
    }
    app_source = (ROOT / "api" / "app.py").read_text()
    collectors = []
    for file, doc in _pod_templates():
        spec = doc["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), file
        for c in spec["template"]["spec"]["containers"]:
            assert c["name"] and c["image"], file
            env = {e["name"]: e for e in c.get("env", [])}
            for ref in re.findall(r"\$\(([A-Z_]+)\)", " ".join(c["args"])):
                assert ref in env, f"{file}: $({ref}) is not defined"
            command, args = parse_forewarn(list(c["args"]))
            for name, e in env.items():
                key = e.get("valueFrom", {}).get("secretKeyRef")
                if key:
                    assert key["key"] in secrets.get(key["name"], set()), f"{file}: {key}"
                if name.startswith("FOREWARN_"):
                    assert name in env_names_read_by(command), f"{file}: {command} ignores {name}"
            ports = {p.get("name") for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe"):
                if probe in c:
                    get = c[probe]["httpGet"]
                    assert get["port"] in ports, f"{file}: {probe} port"
                    assert f'"{get["path"]}"' in app_source, f"{file}: no route {get['path']}"
            if command == "collect":
                collectors.append(args.source)
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec["template"]["spec"].get("volumes", [])}
    assert sorted(collectors) == ["dcgm-exporter", "nvml"]


def test_service_routes_to_the_deployment() -> None:
    objects = _k8s_objects()
    (svc,) = [d for _, d in objects if d["kind"] == "Service"]
    (dep,) = [d for _, d in objects if d["kind"] == "Deployment"]
    assert dep["spec"]["replicas"] >= 2
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    port_names = {
        p["name"] for c in dep["spec"]["template"]["spec"]["containers"] for p in c["ports"]
    }
    assert all(p["targetPort"] in port_names for p in svc["spec"]["ports"])


def test_kustomization_lists_files_that_exist() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for resource in kust["resources"]:
        assert (K8S / resource).is_file(), resource
    text = (K8S / "kustomization.yaml").read_text()
    for path in K8S.glob("*.yaml"):
        assert path.name == "kustomization.yaml" or path.name in text, f"{path.name} unmentioned"
