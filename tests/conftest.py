"""Fixtures shared by every test package: database backends and a live service.

PostgreSQL: ``FOREWARN_TEST_POSTGRES_URL`` (``.ci/run`` creates a fresh database and sets it),
else the local default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``. When it cannot
be reached the PostgreSQL tests skip — except under ``CI=true``, where they fail. Under
pytest-xdist (``make test`` runs two workers) each worker gets a database of its own, named
after that one with the worker's id appended (``test_gw0``), created when missing: the tests
empty their database at will.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, make_url, text

from store import Store

DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# Job files of `forewarn launch` (found by `forewarn migrate --job`) stay within this test
# process and its children: two workers may run jobs with the same id at once.
os.environ.setdefault("FOREWARN_RUN_DIR", tempfile.mkdtemp(prefix="forewarn-test-run-"))


# The files that take longest, longest first: seconds of two `.ci/run`s on 2 cores, from their
# junit reports (`make test PYTEST_ARGS=--junitxml=report.xml`, summed per file). `make test`
# runs pytest-xdist with `--dist loadfile --no-loadscope-reorder`, so each worker takes whole
# files in collection order; started first, the long ones end before the short ones, and no
# worker is left running one long file alone at the end (xdist's own order, by the number of
# tests in a file, put these last: they hold few tests each).
LONGEST_FIRST = (
    "tests/demo/test_demo.py",  # 114-130 s
    "tests/migrator/test_peercopy.py",  # 77 s, plus its node-loss case (30 s)
    "tests/migrator/test_defects.py",  # 93-102 s
    "tests/docs/test_readme.py",  # 91-102 s
    "tests/migrator/test_handover.py",  # 89-93 s
    "tests/migrator/test_nodes.py",  # 61-65 s
    "tests/migrator/test_cli.py",  # 56-57 s
    "tests/deploy/test_wheel.py",  # 50-60 s
    "tests/control/test_e2e_restart.py",  # 53-54 s
    "tests/control/test_straggler_e2e.py",  # 30-60 s
    "tests/migrator/test_fsdp_tp.py",  # 60-70 s with its HSDP + TP base run
    "tests/migrator/test_hsdp.py",  # 50 s
    "tests/migrator/test_preform.py",  # 48-51 s
    "tests/control/test_control_process.py",  # 33 s
    "tests/migrator/test_checkpoint.py",  # 42-45 s
    "tests/migrator/test_fsdp.py",  # 30-36 s
    "tests/control/test_e2e.py",  # 30-35 s (wear that shows at once, tests/control/wear.toml)
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Collect the files of :data:`LONGEST_FIRST` first, in its order; the rest after them,
    in their own order."""
    first = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = Path(__file__).resolve().parents[1]

    def rank(item: pytest.Item) -> int:
        return first.get(item.path.relative_to(root).as_posix(), len(first))

    items.sort(key=rank)


def _own_database(url: str) -> str:
    """This xdist worker's database beside ``url`` (created when missing); ``url`` itself
    outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return url
    base = make_url(url)
    name = f"{base.database}_{worker}"
    admin = create_engine(
        base.set(database="postgres"),
        isolation_level="AUTOCOMMIT",
        connect_args={"connect_timeout": 3},
    )
    try:
        with admin.connect() as c:
            found = c.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name})
            if found.first() is None:
                c.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        admin.dispose()
    return base.set(database=name).render_as_string(hide_password=False)


@functools.cache
def _postgres_url() -> str | None:
    url = os.environ.get("FOREWARN_TEST_POSTGRES_URL") or DEFAULT_PG
    try:
        url = _own_database(url)
        engine = create_engine(url, connect_args={"connect_timeout": 3})
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as exc:
        if IN_CI:
            pytest.fail(f"CI needs PostgreSQL at {url}: {exc}")
        return None
    return url


@pytest.fixture(scope="session")
def postgres_url() -> str:
    url = _postgres_url()
    if url is None:
        pytest.skip("PostgreSQL is not reachable (set FOREWARN_TEST_POSTGRES_URL)")
    return url


def reset_postgres(url: str) -> None:
    """Empty the database: every table, sequence and the Alembic version go."""
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text("DROP SCHEMA IF EXISTS public CASCADE"))
        connection.execute(text("CREATE SCHEMA public"))
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database of each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'forewarn.db'}"
    url: str = request.getfixturevalue("postgres_url")
    reset_postgres(url)
    return url


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    opened = Store.open(database_url)
    yield opened
    opened.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LiveService:
    url: str
    ingest_token: str
    read_token: str
    admin_token: str
    database_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_service(
    database_url: str,
    log_path: Path,
    *,
    port: int | None = None,
    timeout_s: float = 30.0,
    extra: Sequence[str] = (),
) -> LiveService:
    """Start ``forewarn serve`` as its own process (a real uvicorn) and wait until ready;
    ``extra``: more of its options."""
    port = port or free_port()
    tokens = {"ingest": "test-ingest-token", "read": "test-read-token", "admin": "test-admin-token"}
    env = {
        **os.environ,
        "FOREWARN_INGEST_TOKEN": tokens["ingest"],
        "FOREWARN_READ_TOKEN": tokens["read"],
        "FOREWARN_ADMIN_TOKEN": tokens["admin"],
        "FOREWARN_DATA_DIR": str(log_path.parent),
    }
    with log_path.open("ab") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "forewarn",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--database-url",
                database_url,
                "--log-level",
                "warning",
                *extra,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    service = LiveService(
        f"http://127.0.0.1:{port}",
        tokens["ingest"],
        tokens["read"],
        tokens["admin"],
        database_url,
        process,
        log_path,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"service exited with {process.returncode}:\n{service.log()}")
        try:
            if httpx.get(f"{service.url}/readyz", timeout=1.0).status_code == 200:
                return service
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    service.stop()
    raise RuntimeError(f"service not ready after {timeout_s} s:\n{service.log()}")


@pytest.fixture
def live_service(tmp_path: Path) -> Iterator[LiveService]:
    """A real ``forewarn serve`` process on a fresh SQLite database."""
    service = start_service(f"sqlite:///{tmp_path / 'live.db'}", tmp_path / "service.log")
    yield service
    service.stop()
