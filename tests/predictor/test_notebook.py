"""The evaluation notebook runs top to bottom on the tiny fleet (offline, venv kernel)."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]


def test_evaluation_notebook_executes(tiny_dir, tiny_model_path, tmp_path, monkeypatch) -> None:
    nb = nbformat.read(ROOT / "notebooks" / "evaluation.ipynb", as_version=4)
    monkeypatch.setenv("FOREWARN_DATA", str(tiny_dir))
    monkeypatch.setenv("FOREWARN_MODEL", str(tiny_model_path))
    monkeypatch.setenv("FOREWARN_OUT", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    client = NotebookClient(
        nb, kernel_name="python3", timeout=90, resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    for name in ("curves.png", "lead_times.png", "importances.png"):
        assert (tmp_path / name).stat().st_size > 1000
    outputs = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "baseline" in outputs
