"""The straggler term of forewarn goodput: an episode's arithmetic, its place beside the
failures, and numbers that come from the data files, never invented."""

from __future__ import annotations

import argparse
import json
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from goodput import cli
from goodput.compare import Row, Scenario, compare
from goodput.costs import preventive_stall
from goodput.model import Assumptions
from goodput.profile import DEFAULT_PROFILE
from goodput.stragglers import (
    DETECTION_PATH,
    STRAGGLERS_PATH,
    Episode,
    Stragglers,
    cost,
    published,
    schedule,
)

DAY = 86400.0
A = Assumptions()


def test_an_episode_slows_the_job_throughout_unless_forewarn_moves_the_rank() -> None:
    s = Stragglers(episodes_per_gpu_day=1.0, slowdown=2.0, duration_s=3600.0, detect_s=60.0)
    per_transfer, fixed_s = preventive_stall()  # the measured stall, not an assumption
    pause = per_transfer * A.rank_state_gb / A.transfer_gb_s + fixed_s
    assert A.migration_pause_s(1024) == pytest.approx(pause, abs=0.02)
    long, short = Episode(1000.0, 3600.0), Episode(9000.0, 30.0)
    kw = {"pause_s": A.migration_pause_s(1024), "horizon_s": DAY}
    none = cost([long, short], s, mitigate=False, **kw)
    assert none.lost_s == pytest.approx((3600 + 30) * 0.5) and none.moves == 0
    fw = cost([long, short], s, mitigate=True, **kw)
    # the long one: a minute at half speed, then one move; the short one ends before detection
    assert fw.moves == 1 and fw.lost_s == pytest.approx((60 + 30) * 0.5 + A.migration_pause_s(1024))
    assert s.break_even_s(A.migration_pause_s(1024)) == pytest.approx(
        60 + 2 * A.migration_pause_s(1024)
    )
    # overlapping episodes slow the job once
    both = cost([Episode(0.0, 100.0), Episode(50.0, 100.0)], s, mitigate=False, **kw)
    assert both.slow_s == pytest.approx(150.0)
    assert cost([long], replace(s, slowdown=1.0), mitigate=False, **kw).lost_s == 0.0


def test_the_term_lowers_ettr_beside_failures_and_forewarn_keeps_most_of_it() -> None:
    def rows(stragglers: Stragglers | None) -> dict[str, Row]:
        sc = Scenario(gpus=(1024,), sources=("fleet",), days=20.0, stragglers=stragglers)
        return {r.strategy: r for r in compare(sc, A, DEFAULT_PROFILE)}

    plain = rows(None)
    some = rows(Stragglers(0.005, 1.5, 600.0))
    more = rows(Stragglers(0.02, 1.5, 600.0))
    for strategy, r in some.items():
        p = plain[strategy]
        assert r.ettr == p.ettr and p.ettr_with_stragglers is None  # failures alone unchanged
        assert _with(r) < r.ettr
        assert _with(more[strategy]) < _with(r)
        assert more[strategy].straggler_episodes_per_day > 2 * r.straggler_episodes_per_day
    fw, pr = some["forewarn"], some["peer-replica"]
    assert fw.straggler_gpu_hours_lost_per_day < 0.3 * pr.straggler_gpu_hours_lost_per_day
    assert _with(fw) > _with(pr)
    assert pr.straggler_moves_per_day == 0 < fw.straggler_moves_per_day
    episodes = schedule(1024, 20 * DAY, Stragglers(0.005, 1.5, 600.0), np.random.default_rng(3))
    assert abs(len(episodes) / 20 - 0.005 * 1024) < 2.0


def _with(r: Row) -> float:
    """ETTR with the straggler term (the row must have one)."""
    assert r.ettr_with_stragglers is not None
    return r.ettr_with_stragglers


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    rc = cli.run(parser.parse_args(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


BASE = ["--gpus", "1024", "--source", "fleet", "--days", "10", "--sanity-seeds", "0", "--no-png"]


def test_the_numbers_come_from_the_data_file_and_none_is_invented(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = json.loads(STRAGGLERS_PATH.read_text())
    found = published()
    assert doc["episodes_per_gpu_day"] is None and found.episodes_per_gpu_day is None
    assert found.slowdown is None and "No published rate" in (found.missing or "")
    assert found.duration_mean_s == doc["duration_mean_s"]
    assert any("Greyhound" in c and "ATC 2025" in c for c in found.citations)
    # by default: no straggler term in the table, and the command says why
    rc, out, _ = _run(BASE, capsys)
    assert rc == 0 and "ETTR+slow" not in out and "No published rate" in out
    assert "1.34x" in out and "arXiv 2410.12588" in out
    # one of the two what-if numbers alone is refused
    rc, _, err = _run([*BASE, "--straggler-slowdown", "1.5"], capsys)
    assert rc == 2 and "neither is published" in err
    # both given: the term is there, its duration the published one unless told
    rc, out, _ = _run(
        [
            *BASE,
            "--json",
            "--straggler-episodes-per-gpu-day",
            "0.01",
            "--straggler-slowdown",
            "1.5",
        ],
        capsys,
    )
    j = json.loads(out)
    assert j["stragglers"]["term"]["duration_s"] == doc["duration_mean_s"]
    # how soon Forewarn ends an episode: measured end to end, not assumed
    measured = json.loads(DETECTION_PATH.read_text())
    assert j["stragglers"]["term"]["detect_s"] == round(measured["detect_s"], 1)
    assert measured["benchmark"] == "benchmarks/stragglers.py" and len(measured["runs"]) >= 3
    assert j["stragglers"]["published"]["episodes_per_gpu_day"] is None
    by = {r["strategy"]: r for r in j["rows"]}
    assert by["forewarn"]["ettr_with_stragglers"] > by["peer-replica"]["ettr_with_stragglers"]
    rc, out, _ = _run(
        [*BASE, "--straggler-episodes-per-gpu-day", "0.01", "--straggler-slowdown", "1.5"], capsys
    )
    assert "ETTR+slow" in out and "moving pays for an episode longer than" in out


HISTORY = {
    "episodes": 12,
    "ended": 10,
    "rank_days": 400.0,
    "since": "2026-11-01T00:00:00.000+00:00",
    "episodes_per_gpu_day": 0.03,
    "slowdown": 1.8,
    "duration_mean_s": 1500.0,
    "detect_median_s": 125.0,
    "ended_by": {"moved": 7, "cleared": 3},
    "reasons": {"PCIe link at x8 of x16": 12},
}


def test_the_term_from_a_fleets_own_history_file_or_service(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--stragglers-from``: the rate, slowdown and length a service measured on its fleet
    (``GET /v1/stragglers/history``, here as a file and served over HTTP), a flag given
    overriding one of them; what is not a history, or has no rank time, is refused."""
    path = tmp_path / "history.json"
    path.write_text(json.dumps(HISTORY))
    rc, out, _ = _run([*BASE, "--json", "--stragglers-from", str(path)], capsys)
    term = json.loads(out)["stragglers"]["term"]
    assert rc == 0 and (term["episodes_per_gpu_day"], term["slowdown"]) == (0.03, 1.8)
    assert term["duration_s"] == 1500.0 and "12 episodes in 400.00 rank-days" in term["source"]
    rc, out, _ = _run([*BASE, "--stragglers-from", str(path), "--straggler-slowdown", "2"], capsys)
    assert rc == 0 and "ETTR+slow" in out and "the fleet's own history" in out
    assert "slowdown 2x" in out and "overridden by the flags given" in out
    # none ended yet: the published length, and the command says so
    path.write_text(json.dumps({**HISTORY, "ended": 0, "duration_mean_s": None}))
    rc, out, _ = _run([*BASE, "--json", "--stragglers-from", str(path)], capsys)
    term = json.loads(out)["stragglers"]["term"]
    assert term["duration_s"] == published().duration_mean_s and "none ended" in term["source"]
    for body, said in (
        ({**HISTORY, "rank_days": 0.0, "episodes_per_gpu_day": None}, "no rank time"),
        ({"data": []}, "is not a straggler history"),
    ):
        path.write_text(json.dumps(body))
        rc, _, err = _run([*BASE, "--stragglers-from", str(path)], capsys)
        assert rc == 2 and said in err, err
    path.write_bytes(b"\x00" * 64)
    rc, _, err = _run([*BASE, "--stragglers-from", str(path)], capsys)
    assert rc == 2 and "cannot read the straggler history" in err
    rc, _, err = _run([*BASE, "--stragglers-from", str(tmp_path / "absent.json")], capsys)
    assert rc == 2 and "cannot read the straggler history" in err

    seen: list[str | None] = []

    class History(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            body = json.dumps(HISTORY).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), History)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("FOREWARN_TOKEN", "read-token-0123456789")
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1/stragglers/history"
        rc, out, _ = _run([*BASE, "--json", "--stragglers-from", url], capsys)
    finally:
        server.shutdown()
        server.server_close()
    assert rc == 0 and json.loads(out)["stragglers"]["term"]["slowdown"] == 1.8
    assert seen == ["Bearer read-token-0123456789"]
