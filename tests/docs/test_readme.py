"""Every shell command in the README runs, at small scale, as real processes.

The README's ```sh blocks are read line by line (a trailing ``# comment`` dropped). Each
command must have an entry in :data:`CASES`: the script that exercises it here (smaller
fleets, shorter runs, free ports, a scratch directory as the working directory, ``.venv/bin``
first on ``PATH`` as after ``. .venv/bin/activate``), or a ``--help`` check where it needs a
GPU, a cluster or a container engine. A README command without an entry, or an entry whose
command left the README, fails :func:`test_every_readme_command_has_a_case`: the README and
this table change together.

The cases run in README order in one working directory, so a step that reads what an earlier
step wrote (``evaluate`` reads the dataset ``simulate`` wrote) proves the README's order.
The configuration table must equal what :mod:`tests.docs.settings_table` generates from
``api/settings.py``, and every relative link must name a file of the tree.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import _postgres_url, free_port, reset_postgres
from tests.docs.settings_table import settings_table

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
VENV_BIN = ROOT / ".venv" / "bin"
DEV_TOKEN = "forewarn-dev-token"


def readme_commands(text: str | None = None) -> list[str]:
    """The commands of the README's ```sh blocks, in order, continuation lines joined and
    trailing comments dropped."""
    text = README.read_text() if text is None else text
    commands: list[str] = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s+)#\s.*$", "", line).strip()
            if line:
                commands.append(re.sub(r"\s+", " ", line))
    return commands


@dataclass(frozen=True)
class Case:
    """How one README command is exercised.

    ``script`` is bash, run in the scratch working directory, with ``@repo@`` (this tree),
    ``@service@`` (a running ``forewarn serve``: development token, webhooks to 127.0.0.1
    allowed), ``@port@``/``@port2@`` (free ports) and ``@pg@`` (the test PostgreSQL URL)
    replaced. ``mode``: ``run`` exits 0; ``serve`` answers ``/readyz`` on ``@port@`` and stops
    on SIGTERM; ``same`` says another README command's case covers this one (``script`` names
    it). ``expect``: text the output must hold.
    """

    script: str
    mode: str = "run"
    expect: tuple[str, ...] = ()
    slow: bool = False
    why: str = ""


# Small training and evaluation fleets with failures forced on every node, early and late, so
# that a tiny training run finds failures with precursors on both sides of its split.
_INJECT = " ".join(
    f"--inject sim-node-000{n}:1:memory:3600@7200 --inject sim-node-000{n}:2:memory:3600@36000"
    for n in range(8)
)

CASES: dict[str, Case] = {
    "make run": Case(
        "make -n -C @repo@ run | grep 'forewarn demo --host 127.0.0.1 --port 8765' >/dev/null\n"
        "exec forewarn demo --no-story --gpus 16 --port @port@ --data-dir demo-var --duration 2",
        expect=(
            "dashboard   http://127.0.0.1:@port@/",
            "tokens      read demo-read-token-00001",
            "serving http://127.0.0.1:@port@/ for 2 s",
        ),
        slow=True,
        why="the parts and the banner; the story itself is tests/demo/test_demo.py",
    ),
    "make test": Case(
        "make -n -C @repo@ test",
        expect=("ruff check", "mypy", "pytest"),
        why="what it runs; running the whole suite inside it would recurse",
    ),
    ". .venv/bin/activate": Case(
        ". @repo@/.venv/bin/activate && command -v forewarn", expect=("/.venv/bin/forewarn",)
    ),
    "forewarn --help": Case("forewarn --help", expect=("demo",)),
    "make run PORT=9000": Case(
        "make -n -C @repo@ run PORT=9000", expect=("forewarn demo --host 127.0.0.1 --port 9000",)
    ),
    "forewarn demo --duration 30 --json var/demo-summary.json": Case(
        "forewarn demo --help",
        expect=("--duration", "--json"),
        why="the whole story with --duration and --json is tests/demo/test_demo.py",
    ),
    "forewarn demo --no-story": Case("make run", mode="same"),
    "forewarn demo --speed 60 --wear-lead-s 45": Case(
        "forewarn demo --help",
        expect=("--speed", "--wear-lead-s"),
        why=(
            "the whole story at --speed 60 is tests/demo/test_demo.py, with --wear-lead-s 90: "
            "45 (the default physics, twice as fast) left the move ~4 s on a loaded machine"
        ),
    ),
    "forewarn serve": Case("exec forewarn serve --port @port@", mode="serve"),
    "forewarn token create --name rack-12-collectors --scope ingest": Case(
        "forewarn token create --name rack-12-collectors --scope ingest", expect=("shown once",)
    ),
    "forewarn token list": Case("forewarn token list", expect=("rack-12-collectors",)),
    # As written, after the token step, in the same directory (./var holds the token).
    "forewarn serve --host 0.0.0.0 --port 8765": Case(
        "exec forewarn serve --host 0.0.0.0 --port @port@", mode="serve"
    ),
    'forewarn collect --source auto --service http://forewarn:8765 --token "$INGEST_TOKEN" '
    "--kernel-log /dev/kmsg": Case(
        "forewarn collect --help", expect=("--kernel-log",), why="needs a GPU"
    ),
    "forewarn collect --source dcgm-exporter --url http://localhost:9400/metrics --service "
    'http://forewarn:8765 --token "$INGEST_TOKEN"': Case(
        "forewarn collect --help", expect=("dcgm-exporter",), why="needs a dcgm-exporter"
    ),
    "forewarn collect --source simulated --sim-gpus 64 --service http://127.0.0.1:8765 "
    "--token forewarn-dev-token": Case(
        "forewarn collect --source simulated --sim-gpus 16 --service @service@ "
        "--token forewarn-dev-token --duration-s 4 --spool-dir spool\n"
        "curl -sf -H 'Authorization: Bearer forewarn-dev-token' @service@/v1/gpus "
        "| grep sim-node-0001 >/dev/null",
    ),
    "forewarn simulate --gpus 64 --service http://127.0.0.1:8765 --token forewarn-dev-token "
    "--speed 60": Case(
        "forewarn simulate --gpus 16 --service @service@ --token forewarn-dev-token --speed 60 "
        "--control-port @port@ --duration 12 & sim=$!\n"
        "for _ in $(seq 60); do curl -s -o /dev/null http://127.0.0.1:@port@/ && break; "
        "sleep 0.5; done\n"
        "forewarn simulate inject --control http://127.0.0.1:@port@ --node sim-node-0001 "
        "--gpu 3 --kind memory\n"
        "wait $sim",
        slow=True,
    ),
    "forewarn simulate inject --node sim-node-0002 --gpu 3 --kind memory": Case(
        "forewarn simulate --gpus 64 --service http://127.0.0.1:8765 --token "
        "forewarn-dev-token --speed 60",
        mode="same",
    ),
    "forewarn launch --nproc 2 --spares 1 --job-id gpt -- python examples/train_gpt.py "
    "--steps 2000": Case(
        "forewarn launch --nproc 2 --spares 1 --job-id gpt -- python "
        "@repo@/examples/train_gpt.py --steps 80 --pace-s 0.1 & job=$!\n"
        "for _ in $(seq 240); do ls run/gpt.*.json >/dev/null 2>&1 && break; sleep 0.5; done\n"
        "forewarn migrate --job gpt --rank 1 --reason preventive --wait --timeout-s 200\n"
        "forewarn migrate --job gpt --status | grep completed >/dev/null\n"
        "wait $job",
        expect=("completed",),
        slow=True,
    ),
    "forewarn migrate --job gpt --rank 1 --reason preventive --wait": Case(
        "forewarn launch --nproc 2 --spares 1 --job-id gpt -- python examples/train_gpt.py "
        "--steps 2000",
        mode="same",
    ),
    "forewarn migrate --job gpt --status": Case(
        "forewarn launch --nproc 2 --spares 1 --job-id gpt -- python examples/train_gpt.py "
        "--steps 2000",
        mode="same",
    ),
    "forewarn simulate --gpus 1024 --days 7 --seed 100 --interval 60 --out var/ds/train": Case(
        f"forewarn simulate --gpus 64 --days 0.5 --seed 100 --interval 60 --out var/ds/train "
        f"{_INJECT}",
        expect=("16 failures",),
        slow=True,  # the dataset chain runs whole or not at all
    ),
    "forewarn simulate --gpus 1024 --days 7 --seed 200 --interval 60 --out var/ds/eval": Case(
        f"forewarn simulate --gpus 64 --days 0.5 --seed 200 --interval 60 --out var/ds/eval "
        f"{_INJECT}",
        expect=("16 failures",),
        slow=True,  # the dataset chain runs whole or not at all
    ),
    "forewarn train --data var/ds/train --out var/models": Case(
        "forewarn train --data var/ds/train --out var/models --rounds 20 --no-progress",
        expect=("model: var/models/",),
        slow=True,
    ),
    "forewarn evaluate --data var/ds/eval --model var/models --json": Case(
        "forewarn evaluate --data var/ds/eval --model var/models --json --budget 0 --plot ''",
        expect=('"recall"',),
        slow=True,
    ),
    "forewarn goodput": Case(
        "forewarn goodput --gpus 64 --days 7 --runs 1 --sanity-seeds 0 --no-png --source fleet",
        expect=("checkpoint-restart", "peer-replica", "forewarn"),
        why="the full run (two sizes, both sources, sanity check) is tests/goodput/",
    ),
    "FOREWARN_DATABASE_URL=postgresql://forewarn@db:5432/forewarn "
    'FOREWARN_ADMIN_TOKEN="$ADMIN_TOKEN" forewarn serve --host 0.0.0.0 --workers 2': Case(
        "export ADMIN_TOKEN=admin-token-0123456789\nFOREWARN_DATABASE_URL=@pg@ "
        'FOREWARN_ADMIN_TOKEN="$ADMIN_TOKEN" exec forewarn serve --host 0.0.0.0 --port @port@ '
        "--workers 2",
        mode="serve",
        slow=True,
    ),
    "FOREWARN_WEBHOOK_ALLOW=127.0.0.1 forewarn serve": Case(
        # The walk-through as a newcomer runs it, a free port for each of its two services.
        'hook=$(python -c \'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); '
        "print(s.getsockname()[1])')\n"
        "FOREWARN_WEBHOOK_ALLOW=127.0.0.1 forewarn serve --port @port@ --data-dir hook-var "
        "& svc=$!\n"
        "trap 'kill $svc $recv 2>/dev/null' EXIT\n"
        "for _ in $(seq 240); do curl -sf http://127.0.0.1:@port@/readyz >/dev/null && break; "
        "sleep 0.5; done\n"
        "curl -s -X POST http://127.0.0.1:@port@/v1/webhooks -H 'Authorization: Bearer "
        "forewarn-dev-token' -H 'content-type: application/json' -d '{\"url\": "
        '"http://127.0.0.1:\'$hook\'/", "event_types": ["node.drained", '
        '"migration.completed"]}\' > subscription.json\n'
        "FOREWARN_WEBHOOK_SECRET=$(python -c 'import json; print(json.load(open("
        '"subscription.json"))["secret"])\') python @repo@/examples/webhook_receiver.py '
        "--port $hook > receiver.log & recv=$!\n"
        "for _ in $(seq 60); do grep -q listening receiver.log && break; sleep 0.5; done\n"
        "curl -s -X POST http://127.0.0.1:@port@/v1/nodes/gpu-node-17/drain -H "
        "'Authorization: Bearer forewarn-dev-token'\n"
        "for _ in $(seq 120); do grep -q node.drained receiver.log && break; sleep 0.5; done\n"
        "cat receiver.log",
        expect=("listening on http://127.0.0.1:", "node.drained"),
    ),
    "curl -s -X POST http://127.0.0.1:8765/v1/webhooks -H 'Authorization: Bearer "
    "forewarn-dev-token' -H 'content-type: application/json' -d '{\"url\": "
    '"http://127.0.0.1:9000/", "event_types": ["node.drained", "migration.completed"]}\' > '
    "subscription.json": Case("FOREWARN_WEBHOOK_ALLOW=127.0.0.1 forewarn serve", mode="same"),
    "FOREWARN_WEBHOOK_SECRET=$(python -c 'import json; print(json.load(open(\"subscription.json"
    '"))["secret"])\') python examples/webhook_receiver.py --port 9000 &': Case(
        "FOREWARN_WEBHOOK_ALLOW=127.0.0.1 forewarn serve", mode="same"
    ),
    "curl -s -X POST http://127.0.0.1:8765/v1/nodes/gpu-node-17/drain -H 'Authorization: "
    "Bearer forewarn-dev-token'": Case(
        "FOREWARN_WEBHOOK_ALLOW=127.0.0.1 forewarn serve", mode="same"
    ),
}


def test_every_readme_command_has_a_case() -> None:
    commands = readme_commands()
    missing = [c for c in commands if c not in CASES]
    stale = [c for c in CASES if c not in commands]
    assert not missing, f"README commands without a case in CASES: {missing}"
    assert not stale, f"CASES entries no longer in the README: {stale}"
    for command, case in CASES.items():
        if case.mode == "same":
            assert case.script in CASES and CASES[case.script].mode != "same", command


def test_the_configuration_table_is_generated_from_the_settings() -> None:
    table = settings_table()
    assert table in README.read_text(), (
        "the README's configuration table differs from api/settings.py; paste the output of "
        "`.venv/bin/python -m tests.docs.settings_table`"
    )


def test_links_name_files_of_the_tree_and_nothing_outside_it() -> None:
    text = README.read_text()
    assert "../shared" not in text
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("readme")


def _env(workdir: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("FOREWARN_") and k not in ("VIRTUAL_ENV", "PYTHONHOME")
    }
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(ROOT / ".venv"),
        FOREWARN_RUN_DIR=str(workdir / "run"),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture(scope="module")
def service(workdir: Path) -> Iterator[str]:
    """``forewarn serve`` as the README starts it: no configuration, the development token."""
    port = free_port()
    env = {**_env(workdir), "FOREWARN_WEBHOOK_ALLOW": "127.0.0.1"}
    log = (workdir / "service.log").open("ab")
    with log:
        process = subprocess.Popen(
            [str(VENV_BIN / "forewarn"), "serve", "--port", str(port), "--data-dir", "svc-var"],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process, workdir / "service.log")
        yield url
    finally:
        _stop(process)


def _wait_ready(
    url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float = 120
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} not ready in {timeout_s} s:\n{log.read_text()[-3000:]}")


def _stop(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    return process.returncode


def _params() -> list[object]:
    params: list[object] = []
    for command, case in CASES.items():
        if case.mode == "same":
            continue
        marks = [pytest.mark.slow] if case.slow else []
        if "@pg@" in case.script:
            marks.append(pytest.mark.postgres)
        params.append(pytest.param(command, case, marks=marks, id=command[:60]))
    return params


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("command", "case"), _params())
def test_readme_command_runs(
    command: str, case: Case, workdir: Path, request: pytest.FixtureRequest
) -> None:
    script = case.script.replace("@repo@", str(ROOT))
    port = free_port()
    script = script.replace("@port@", str(port)).replace("@port2@", str(free_port()))
    if "@service@" in script:
        script = script.replace("@service@", request.getfixturevalue("service"))
    if "@pg@" in script:
        url = _postgres_url()
        if url is None:
            pytest.skip("PostgreSQL is not reachable (set FOREWARN_TEST_POSTGRES_URL)")
        reset_postgres(url)
        script = script.replace("@pg@", url)
    expect = [e.replace("@port@", str(port)) for e in case.expect]
    log_path = workdir / f"case-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=workdir,
            env=_env(workdir),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        if case.mode == "serve":
            _wait_ready(f"http://127.0.0.1:{port}", process, log_path)
            _stop(process)
        else:
            process.wait(timeout=280)
    finally:
        _stop(process)
    output = log_path.read_text(errors="replace")
    if case.mode == "run":
        assert process.returncode == 0, f"{command}\n--- as run here:\n{script}\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]
    for text in expect:
        assert text in output, f"{text!r} not in the output of\n{script}\n{output[-4000:]}"
