"""The rooms of DESIGN.md and who may enter: checked on the source, import by import.

Collectors run on GPU nodes and the migrator inside training jobs, so neither may pull in the
server; the predictor gets frames, never a database session or a web request.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "collector": {
        "sim",
        "api",
        "store",
        "predictor",
        "migrator",
        "torch",
        "sqlalchemy",
        "fastapi",
        "pandas",
        "uvicorn",
    },
    "migrator": {"api", "store", "predictor", "collector", "sqlalchemy", "fastapi", "uvicorn"},
    "sim": {
        "api",
        "store",
        "predictor",
        "migrator",
        "collector",
        "torch",
        "sqlalchemy",
        "fastapi",
        "uvicorn",
        "httpx",
    },
    "predictor": {"api", "store", "migrator", "fastapi", "sqlalchemy", "uvicorn", "torch", "httpx"},
    "store": {"api", "predictor", "migrator", "collector", "fastapi", "torch"},
    "forewarn": {
        "api",
        "store",
        "predictor",
        "migrator",
        "collector",
        "torch",
        "sqlalchemy",
        "fastapi",
        "pandas",
        "numpy",
    },
    "api": {"torch"},
    "control": {"api", "migrator", "collector", "sim", "torch", "fastapi", "starlette", "uvicorn"},
    "goodput": {
        "api",
        "store",
        "predictor",
        "migrator",
        "collector",
        "torch",
        "sqlalchemy",
        "fastapi",
        "pandas",
        "uvicorn",
        "httpx",
        "lightgbm",
    },
}
# Modules allowed past the rule, with the reason: ``forewarn simulate`` streams its fleet
# through the collector's pusher (it is a collector with the simulated source) and posts to the
# control API of a running simulator; the fleet model itself imports neither. The predictor's
# Prometheus importer asks Prometheus' HTTP API for a fleet's history (DESIGN.md).
# The dataset schema (forewarn/datasets.py) builds its Arrow form with pandas inside the one
# function that the server's readers and writers call; a node never calls it.
ALLOWED = {
    ("forewarn", "pandas"): ("forewarn/datasets.py",),
    ("sim", "collector"): ("sim/cli.py",),
    ("sim", "httpx"): ("sim/cli.py",),
    ("predictor", "httpx"): ("predictor/prometheus_import.py",),
}
# The command dispatcher names every room as a string, and imports them lazily.
SKIP = {"forewarn/cli.py"}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_only_what_it_may(room: str) -> None:
    offences = []
    for path in sorted((ROOT / room).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in SKIP:
            continue
        for name in sorted(imports_of(path) & FORBIDDEN[room]):
            if any(rel.startswith(p) for p in ALLOWED.get((room, name), ())):
                continue
            offences.append(f"{rel} imports {name}")
    assert not offences, "\n".join(offences)


# Packages that are no room of the table: the demo runs every part (the service, a collector
# and a training job with torch) as a show, and tests test everything.
NOT_ROOMS = {"demo", "tests"}


def test_every_room_of_the_architecture_table_is_checked() -> None:
    table = (ROOT / "docs" / "architecture.md").read_text()
    rooms = set(re.findall(r"^\| `(\w+)/` \|", table, flags=re.MULTILINE))
    assert {"collector", "store", "api"} <= rooms  # the table was read
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    data_only = {r for r in rooms if r not in packages}  # models/: data, not code
    assert rooms - data_only <= set(FORBIDDEN), "a room of the table has no import rule here"
    assert packages - NOT_ROOMS <= rooms, "a package is in no room of docs/architecture.md"
