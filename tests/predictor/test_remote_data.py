"""A dataset behind an fsspec URL (here the in-memory filesystem, as S3 would be) is read as
a local one: ``forewarn train --data URL`` needs no download step."""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import numpy as np

from forewarn.cli import main
from predictor.dataset import load_dataset, read_failures, read_manifest


def _upload(local: Path) -> str:
    fs = fsspec.filesystem("memory")
    root = f"/ds-{uuid.uuid4().hex[:8]}"
    for path in local.rglob("*"):
        if path.is_file():
            fs.pipe(f"{root}/{path.relative_to(local).as_posix()}", path.read_bytes())
    return f"memory://{root}"


def test_a_dataset_url_reads_as_the_directory_does(tiny_dir: Path, tmp_path: Path) -> None:
    url = _upload(tiny_dir)
    here, there = load_dataset(tiny_dir), load_dataset(url)
    assert there.path == url and read_manifest(url) == here.manifest
    assert np.array_equal(there.samples.ts_ms, here.samples.ts_ms)
    assert np.array_equal(there.samples.values, here.samples.values, equal_nan=True)
    assert there.failures.equals(here.failures) and there.events.equals(here.events)
    assert read_failures(url).equals(here.failures)
    out = tmp_path / "models"
    argv = ["train", "--data", url, "--out", str(out), "--rounds", "5", "--no-progress"]
    assert main(argv) == 0
    assert list(out.glob("*.lgb.txt"))
    argv = ["evaluate", "--data", url, "--model", str(out), "--json", "--plot", ""]
    assert main(argv) == 0
