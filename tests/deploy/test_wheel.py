"""The wheel installs lean: a GPU node gets the collector without the server or torch.

The wheel is built once from a copy of the source tree, then installed into fresh virtual
environments (no system site-packages), each with one extra, and each command's ``--help`` is
run from the installed console script:

- base (what ``pip install forewarn`` or ``forewarn[node]`` brings): ``forewarn collect`` runs,
  and neither FastAPI, SQLAlchemy, pandas, LightGBM nor torch is installed;
- ``[server]`` added on top: ``forewarn serve`` runs, torch is still absent;
- ``[train]`` alone: ``forewarn launch`` runs, FastAPI is absent.

The installs use pip's own configuration (its indexes and find-links). ``[train]`` installs
torch only when pip would take it from a local file (a CPU wheel in a find-links folder);
otherwise it would download gigabytes, so the test installs the wheel with ``--no-deps``,
checks that torch is declared, and skips only the command run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
SERVER_ONLY = ("fastapi", "uvicorn", "sqlalchemy", "alembic", "pandas", "pyarrow", "lightgbm")
INSTALL_TIMEOUT_S = 600

# Top-level names of imported modules the collector must never load.
PROBE = """
import sys
from forewarn.cli import main
try:
    main([{command!r}, "--help"])
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
heavy = sorted({{m.split(".")[0] for m in sys.modules}} & set({forbidden!r}))
print("HEAVY=" + ",".join(heavy))
"""


def _copy_source(dest: Path) -> Path:
    """The project's files without build outputs, virtual environments or data."""
    skip = {
        ".venv",
        ".git",
        "var",
        "build",
        "dist",
        ".mypy_cache",
        ".ruff_cache",
        ".pytest_cache",
        ".hypothesis",
        "__pycache__",
        "node_modules",
    }

    def ignore(_dir: str, names: list[str]) -> set[str]:
        return {n for n in names if n in skip or n.endswith(".egg-info")}

    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


def _run(cmd: list[str], timeout: float = INSTALL_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, f"{cmd}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = _copy_source(tmp_path_factory.mktemp("src") / "forewarn")
    out = tmp_path_factory.mktemp("wheel")
    _run(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        timeout=300,
    )
    (built,) = out.glob("forewarn-*.whl")
    return built


def _metadata(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return zf.read(name).decode().splitlines()


def _requires(wheel: Path, extra: str | None) -> set[str]:
    """Distribution names required by the base install (None) or by one extra."""
    names = set()
    for line in _metadata(wheel):
        if not line.startswith("Requires-Dist: "):
            continue
        spec, _, marker = line.removeprefix("Requires-Dist: ").partition(";")
        in_extra = f'extra == "{extra}"' in marker if extra else not marker.strip()
        if in_extra:
            name = spec.strip().split("[")[0]
            for op in "<>=!~ ":
                name = name.split(op)[0]
            names.add(name.lower())
    return names


class Venv:
    def __init__(self, path: Path) -> None:
        _run([sys.executable, "-m", "venv", "--without-pip", str(path)], timeout=120)
        self.path = path
        self.python = path / "bin" / "python"

    def install(self, *requirements: str, no_deps: bool = False) -> None:
        flags = ["--no-deps"] if no_deps else []
        _run(
            [
                *PIP,
                "--python",
                str(self.python),
                "install",
                "-q",
                "--no-compile",
                *flags,
                *requirements,
            ]
        )

    def has(self, module: str) -> bool:
        code = f"import importlib.util as u; print(u.find_spec({module!r}) is not None)"
        return _run([str(self.python), "-c", code], timeout=60).stdout.strip() == "True"

    def forewarn(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.path / "bin" / "forewarn"), *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=self.path.parent,  # away from the source tree and its models/
        )

    def heavy_imports(self, command: str, forbidden: tuple[str, ...]) -> list[str]:
        code = PROBE.format(command=command, forbidden=forbidden)
        out = _run([str(self.python), "-c", code], timeout=120).stdout
        line = next(x for x in out.splitlines() if x.startswith("HEAVY="))
        return [m for m in line.removeprefix("HEAVY=").split(",") if m]


@pytest.fixture
def venv(tmp_path: Path) -> Iterator[Venv]:
    yield Venv(tmp_path / "venv")


def test_metadata_keeps_the_base_lean(wheel: Path) -> None:
    base = _requires(wheel, None)
    assert base == {"pydantic", "httpx", "numpy"}
    assert {"fastapi", "sqlalchemy", "lightgbm", "pandas", "uvicorn"} <= _requires(wheel, "server")
    assert _requires(wheel, "train") == {"torch", "setproctitle"}
    assert 'Requires-Dist: torch<2.14,>=2.4; extra == "train"' in _metadata(wheel)
    assert _requires(wheel, "nvidia") == {"nvidia-ml-py"}
    assert _requires(wheel, "amd") == {"amdsmi"}
    assert "Provides-Extra: node" in _metadata(wheel)
    assert "forewarn" in _requires(wheel, "dev")  # dev = forewarn[server,train] + tools
    assert any(
        line.startswith("Requires-Dist: forewarn[") and "server" in line and "train" in line
        for line in _metadata(wheel)
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_node_install_then_server(wheel: Path, venv: Venv) -> None:
    venv.install(f"{wheel}[node]")
    result = venv.forewarn("collect", "--help")
    assert result.returncode == 0, result.stderr
    assert "--service" in result.stdout
    assert "simulated" in result.stdout  # the simulator's source, found by its entry point
    for module in (*SERVER_ONLY, "torch"):
        assert not venv.has(module), f"{module} came with the base install"
    assert venv.heavy_imports("collect", (*SERVER_ONLY, "torch")) == []
    # The goodput model runs from the wheel alone, on the trace copy shipped in it.
    result = venv.forewarn(
        "goodput",
        "--gpus",
        "64",
        "--days",
        "30",
        "--source",
        "trace",
        "--sanity-seeds",
        "1",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["png"] is None and "matplotlib" in doc["png_note"]
    assert "shipped copy" in doc["trace"] and len(doc["rows"]) == 3

    venv.install(f"{wheel}[server]")
    result = venv.forewarn("serve", "--help")
    assert result.returncode == 0, result.stderr
    assert "--port" in result.stdout
    assert not venv.has("torch")
    # The service scores with the model shipped in the wheel when ./models holds none.
    probe = (
        "from api.settings import Settings; from api.control_service import load_model; "
        "m = load_model(Settings()); print('MODEL', m.card['booster_file'] if m else None)"
    )
    result = subprocess.run(
        [str(venv.python), "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=venv.path.parent,
    )
    assert result.returncode == 0, result.stderr
    assert "MODEL forewarn-risk-" in result.stdout, result.stdout + result.stderr


def _torch_is_local(wheel: Path, venv: Venv) -> bool:
    """True when pip would install torch for ``[train]`` from a local file, not a download."""
    result = _run(
        [
            *PIP,
            "--python",
            str(venv.python),
            "install",
            "--dry-run",
            "-q",
            "--report",
            "-",
            f"{wheel}[train]",
        ]
    )
    report = json.loads(result.stdout)
    for item in report["install"]:
        if item["metadata"]["name"].lower() == "torch":
            return str(item["download_info"]["url"]).startswith("file:")
    return True  # already satisfied: nothing to download


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_install(wheel: Path, venv: Venv) -> None:
    if not _torch_is_local(wheel, venv):
        # torch would come from the network (gigabytes): check the declaration only.
        venv.install(str(wheel), no_deps=True)
        assert 'Requires-Dist: torch<2.14,>=2.4; extra == "train"' in _metadata(wheel)
        pytest.skip("no local torch wheel for pip; [train] checked by its metadata only")
    venv.install(f"{wheel}[train]")
    result = venv.forewarn("launch", "--help")
    assert result.returncode == 0, result.stderr
    assert "--spares" in result.stdout
    assert venv.has("torch")
    for module in ("fastapi", "sqlalchemy", "lightgbm"):
        assert not venv.has(module), f"{module} came with [train]"
