"""Live scoring of a 16,384-GPU fleet per tick: features + predict (+ reasons for GPUs at
risk), against the model's bare predict on the same rows, in the same run.

A simulated fleet supplies real sample frames (the store's columns); the scorer is warmed with
an hour of ticks, then each timed tick hands it one new frame of 16,384 rows, as the control
loop does. Uses the newest model in models/, else the shipped one.
Goal: under 1 s per tick.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from predictor import registry  # noqa: E402
from predictor.scoring import Scorer  # noqa: E402
from sim import generate_dataset  # noqa: E402

GPUS = 16_384
WARM_TICKS = 60
TIMED_TICKS = 10


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = registry.load_default(ROOT / "models")
        ds = Path(tmp) / "fleet"
        generate_dataset(
            ds, gpus=GPUS, days=(WARM_TICKS + TIMED_TICKS) / 1440, interval_s=60, seed=9
        )
        frame = pd.read_parquet(ds / "samples")
        events = pd.read_parquet(ds / "events.parquet")
    ticks = [g for _, g in frame.groupby("ts_ms", sort=True)]
    scorer = Scorer(model)
    for tick in ticks[:WARM_TICKS]:
        t = int(tick["ts_ms"].iat[0])
        scorer.update(
            tick, events[(events["ts_ms"] > t - 60_000) & (events["ts_ms"] <= t)], now_ms=t
        )
    full, feats, bare = [], [], []
    for tick in ticks[WARM_TICKS:]:
        t = int(tick["ts_ms"].iat[0])
        ev = events[(events["ts_ms"] > t - 60_000) & (events["ts_ms"] <= t)]
        t0 = time.perf_counter()
        scorer.update(tick, ev, now_ms=t)
        x = scorer.features()
        t1 = time.perf_counter()
        out = scorer.score()
        t2 = time.perf_counter()
        model.raw(x)
        t3 = time.perf_counter()
        feats.append(t1 - t0)
        full.append((t1 - t0) + (t2 - t1))  # score() recomputes features: count them once
        bare.append(t3 - t2)
    n = len(out)
    hot = int((out["reasons"].map(len) > 0).sum())
    f, s, b = np.median(feats), np.median(full), np.median(bare)
    print(
        f"fleet: {n} GPUs, {len(model.card.get('features', []))} features, {hot} GPUs with reasons"
    )
    print(f"update + features per tick: {f * 1000:8.1f} ms")
    print(f"update + score per tick:    {s * 1000:8.1f} ms   (features twice; goal < 1000 ms)")
    print(f"bare model predict:         {b * 1000:8.1f} ms")
    print(f"ratio score / bare predict: {s / b:8.2f}x")


if __name__ == "__main__":
    main()
