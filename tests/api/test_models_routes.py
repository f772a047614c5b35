"""``/v1/models``: the models, the one in force, pin, unpin, roll back, through the app."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from predictor import registry
from tests.api.conftest import READ, make_settings

ADMIN = {"Authorization": "Bearer admin-token-0123456789abcdef"}
OLD, NEW = "forewarn-risk-20260101T000000Z", "forewarn-risk-20260102T000000Z"


def test_pin_unpin_and_rollback_through_the_api(tmp_path: Path) -> None:
    models = tmp_path / "models"
    shipped = registry.load_latest(registry.SHIPPED_DIR)
    for stem in (OLD, NEW):
        registry.save(shipped, models, stem=stem)
    settings = make_settings(
        f"sqlite:///{tmp_path / 'api.db'}",
        tmp_path,
        models_dir=models,
        admin_token=ADMIN["Authorization"].split()[1],
        control_enabled=False,
    )
    with TestClient(create_app(settings)) as client:
        body = client.get("/v1/models", headers=READ).json()
        assert body["in_force"] == NEW and not body["pinned"] and body["history"] == []
        ids = [m["id"] for m in body["data"]]
        assert {OLD, NEW} <= set(ids) and body["count"] == len(ids)

        r = client.post("/v1/models/pin", json={"model_id": OLD}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json()["in_force"] == OLD and r.json()["pinned"]
        assert r.json()["replaced"] == [NEW]

        # a path is not a model id; an unknown id is not found; neither changes anything
        bad = client.post("/v1/models/pin", json={"model_id": "../api"}, headers=ADMIN)
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_input"
        missing = client.post("/v1/models/pin", json={"model_id": "nope"}, headers=ADMIN)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        assert (
            client.post("/v1/models/pin", json={"model_id": NEW}, headers=READ).status_code == 403
        )

        r = client.post("/v1/models/unpin", headers=ADMIN)
        assert r.status_code == 200 and not r.json()["pinned"]
        r = client.post("/v1/models/rollback", headers=ADMIN)
        assert r.status_code == 200 and r.json()["in_force"] == NEW
        again = client.post("/v1/models/rollback", headers=ADMIN)
        assert again.status_code == 409 and again.json()["error"]["code"] == "conflict"
        actions = [h["action"] for h in client.get("/v1/models", headers=READ).json()["history"]]
        assert actions == ["pinned", "unpinned", "rolled_back"]


def test_changes_are_refused_when_a_model_file_is_configured(tmp_path: Path) -> None:
    card = registry.save(registry.load_latest(registry.SHIPPED_DIR), tmp_path / "m", stem=OLD)
    settings = make_settings(
        f"sqlite:///{tmp_path / 'api.db'}",
        tmp_path,
        model=card,
        admin_token=ADMIN["Authorization"].split()[1],
        control_enabled=False,
    )
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/models/rollback", headers=ADMIN)
        assert r.status_code == 409 and "FOREWARN_MODEL" in r.json()["error"]["message"]


@pytest.mark.timeout(600)
def test_retrain_runs_in_a_worker_on_the_fleets_history_and_the_lifecycle_judges_it(
    tmp_path: Path,
) -> None:
    """The fleet's history (a dataset directory, as the store's tiering writes it) trains a
    candidate on top of the model in force while the service answers; one retraining at a
    time; the decision is the lifecycle's."""
    from predictor.train import train
    from sim import generate_dataset
    from tests.predictor.conftest import INJECTIONS, TINY_CONFIG

    history = tmp_path / "history"
    generate_dataset(history, gpus=32, days=0.5, interval_s=60.0, seed=11, injections=INJECTIONS)
    models = tmp_path / "models"
    registry.save(train([history], TINY_CONFIG), models, stem=OLD)
    settings = make_settings(
        f"sqlite:///{tmp_path / 'api.db'}",
        tmp_path,
        models_dir=models,
        history_url=str(history),
        admin_token=ADMIN["Authorization"].split()[1],
        control_enabled=False,
    )
    with TestClient(create_app(settings)) as client:
        assert client.get("/v1/models/retrain", headers=READ).json()["state"] == "idle"
        r = client.post("/v1/models/retrain", json={"holdout_days": 0.2}, headers=ADMIN)
        assert r.status_code == 202 and r.json()["state"] == "running", r.text
        again = client.post("/v1/models/retrain", headers=ADMIN)
        assert again.status_code == 409
        assert client.get("/v1/models", headers=READ).status_code == 200  # the service answers
        deadline = time.monotonic() + 500
        while (job := client.get("/v1/models/retrain", headers=READ).json())["state"] == "running":
            assert time.monotonic() < deadline, "the retraining did not finish"
            time.sleep(0.5)
        assert job["state"] == "done", job
        decision = job["decision"]
        assert decision["action"] == "judged" and decision["in_force"] == OLD
        assert (models / f"{decision['candidate']}.json").is_file()
        body = client.get("/v1/models", headers=READ).json()
        assert body["history"][-1]["candidate"] == decision["candidate"]
        bad = client.post("/v1/models/retrain", json={"holdout_days": 0}, headers=ADMIN)
        assert bad.status_code == 422


def test_retraining_runs_on_a_schedule_and_says_it_was_the_schedule(tmp_path: Path) -> None:
    """``FOREWARN_RETRAIN_EVERY_H`` starts the same retraining as the API, with nobody asking;
    here the service keeps no history, so it fails at once and says why."""
    settings = make_settings(
        f"sqlite:///{tmp_path / 'api.db'}",
        tmp_path,
        models_dir=tmp_path / "models",
        history_url="none",
        control_enabled=False,
        retrain_every_h=0.5 / 3600,
    )
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 60
        while (job := client.get("/v1/models/retrain", headers=READ).json())["state"] in (
            "idle",
            "running",
        ):
            assert time.monotonic() < deadline, "no scheduled retraining started"
            time.sleep(0.1)
    assert job["trigger"] == "schedule" and job["state"] == "failed", job
    assert "keeps no history" in job["error"]
