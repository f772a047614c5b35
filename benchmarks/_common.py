"""Small helpers shared by the benchmark scripts (not a test suite: plain scripts)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/forewarn_bench"
"""A database of the benchmarks' own (created when missing): each run empties it, so it must
not be one that tests or a service use at the same time."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def postgres_url() -> str | None:
    """The benchmark database on PostgreSQL, or None when none answers."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    url = os.environ.get("FOREWARN_BENCH_POSTGRES_URL", DEFAULT_PG)
    try:
        parsed = make_url(url)
        admin = create_engine(
            parsed.set(database="postgres"),
            isolation_level="AUTOCOMMIT",
            connect_args={"connect_timeout": 3},
        )
        try:
            with admin.connect() as c:
                found = c.execute(
                    text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": parsed.database}
                )
                if found.first() is None:
                    c.execute(text(f'CREATE DATABASE "{parsed.database}"'))
        finally:
            admin.dispose()
        engine = create_engine(url, connect_args={"connect_timeout": 3})
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        engine.dispose()
    except Exception:
        return None
    return url


def reset_postgres(url: str) -> None:
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text("DROP SCHEMA IF EXISTS public CASCADE"))
        connection.execute(text("CREATE SCHEMA public"))
    engine.dispose()


class Service:
    """``forewarn serve`` in its own process, for end-to-end figures over loopback."""

    def __init__(
        self,
        database_url: str,
        log_path: Path,
        token: str = "bench-token",
        env: dict[str, str] | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        env = {
            **os.environ,
            "FOREWARN_ADMIN_TOKEN": token,
            "FOREWARN_DATA_DIR": str(log_path.parent),
            **(env or {}),
        }
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "forewarn",
                    "serve",
                    "--port",
                    str(self.port),
                    "--database-url",
                    database_url,
                    "--log-level",
                    "warning",
                    *extra,
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"service did not start; see {log_path}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its live children (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        return float("nan")
    total = 0.0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "n/a"


async def post_raw(
    url: str, path: str, headers: dict[str, str], bodies: list[bytes], concurrency: int
) -> list[bytes]:
    """POST every body over ``concurrency`` keep-alive connections; return the response bodies.

    A deliberately thin HTTP/1.1 client (pre-built requests, Content-Length responses only):
    the load generator shares the machine with the server, so it must cost little per request.
    Any status other than 200 stops the run.
    """
    import asyncio
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    start = f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n{head}"
    requests = [f"{start}Content-Length: {len(b)}\r\n\r\n".encode() + b for b in bodies]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(requests)):
        queue.put_nowait(i)
    responses: list[bytes] = [b""] * len(requests)

    async def worker() -> None:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            while not queue.empty():
                i = queue.get_nowait()
                writer.write(requests[i])
                status = await reader.readline()
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                if b" 200 " not in status:
                    raise RuntimeError(f"{status.decode().strip()}: {body[:300]!r}")
                responses[i] = body
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return responses
