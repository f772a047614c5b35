"""The StepFun fault trace: real fault arrivals to replay, and the copy this package ships.

The trace (stepfun-ai/InfiniteHBD-Trace, SIGCOMM 2025, Apache-2.0) lists 584 faults on 400
GPU servers (8 GPUs each) over 349 days of LLM pre-training: node, start and end (days), and a
Level/Class/Desc taxonomy. ``derive`` pairs each fault's start with its end and writes one row
per fault to ``goodput/data/stepfun_faults.tsv`` (node numbered by first appearance); that
small table ships in the wheel, so ``forewarn goodput --source trace`` works from an installed
package. ``load`` reads either the original directory (``fault_trace.json``) or that table.

Which faults stop a job, and which failure kind each becomes, is the simulator's table
(``[[trace_classes]]`` in ``sim/defaults.toml``): one mapping for the fleet model and for the
replay. Faults of the levels "Software Failure" and "Other Failure" (unknown errors,
stress-test failures, machines taken offline for troubleshooting) are not replayed by default:
the trace does not say whether they stopped the training job.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

__all__ = [
    "TRACE_DAYS",
    "TRACE_GPUS_PER_NODE",
    "TRACE_NODES",
    "TraceFault",
    "derive",
    "find_trace_dir",
    "load",
]

TRACE_NODES = 400
TRACE_GPUS_PER_NODE = 8
TRACE_DAYS = 349.0
SHIPPED = "stepfun_faults.tsv"
COLUMNS = ("start_day", "end_day", "node", "level", "class", "desc")
HEADER = (
    "# Derived from the StepFun fault trace (stepfun-ai/InfiniteHBD-Trace, SIGCOMM 2025,\n"
    "# arXiv 2502.03885; Apache-2.0, see stepfun-LICENSE.txt beside this file): one row per\n"
    "# fault, start and end in days, node numbered by first appearance (400 servers of 8\n"
    "# GPUs, 349 days). Written by goodput.trace.derive; do not edit by hand.\n"
)


@dataclass(frozen=True)
class TraceFault:
    """One fault of the trace: when it started and ended (days), where, and what it was."""

    start_day: float
    end_day: float | None
    node: int
    level: str
    cls: str
    desc: str


def _pair(events: list[dict]) -> list[TraceFault]:
    """Faults from start/end events: each start is closed by the next end of the same fault."""
    nodes: dict[str, int] = {}
    open_: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    faults: list[dict] = []
    for ev in sorted(events, key=lambda e: (e["event_time"], e["event_type"] != "fault_end")):
        ft = ev["fault_type"]
        node = nodes.setdefault(ev["node_id"], len(nodes))
        key = (ev["node_id"], ft["Class"], ft["Desc"])
        if ev["event_type"] == "fault_start":
            open_[key].append(len(faults))
            faults.append(
                {
                    "start_day": float(ev["event_time"]),
                    "end_day": None,
                    "node": node,
                    "level": ft["Level"],
                    "cls": ft["Class"],
                    "desc": ft["Desc"],
                }
            )
        elif open_[key]:
            faults[open_[key].pop(0)]["end_day"] = float(ev["event_time"])
    return [TraceFault(**f) for f in faults]


def derive(trace_dir: str | Path, out: str | Path) -> int:
    """Write the shipped table from the original trace directory; returns the fault count."""
    faults = _pair(json.loads((Path(trace_dir) / "fault_trace.json").read_text()))
    lines = [HEADER, "\t".join(COLUMNS) + "\n"]
    for f in faults:
        end = "" if f.end_day is None else f"{f.end_day:.4f}"
        lines.append(f"{f.start_day:.4f}\t{end}\t{f.node}\t{f.level}\t{f.cls}\t{f.desc}\n")
    Path(out).write_text("".join(lines))
    return len(faults)


def _parse_table(text: str) -> list[TraceFault]:
    rows = [line for line in text.splitlines() if line and not line.startswith("#")]
    if not rows or tuple(rows[0].split("\t")) != COLUMNS:
        raise ValueError(f"not a fault table (expected columns {COLUMNS})")
    faults = []
    for line in rows[1:]:
        start, end, node, level, cls, desc = line.split("\t")
        faults.append(
            TraceFault(float(start), float(end) if end else None, int(node), level, cls, desc)
        )
    return faults


def find_trace_dir(start: Path | None = None) -> Path | None:
    """The original trace beside a source checkout (``../shared/data/stepfun-fault-trace``)."""
    here = (start or Path(__file__)).resolve()
    if "site-packages" in here.parts:  # an installed wheel: no checkout beside it
        return None
    for parent in here.parents:
        candidate = parent / "shared" / "data" / "stepfun-fault-trace"
        if (candidate / "fault_trace.json").is_file():
            return candidate
    return None


def load(path: str | Path | None = None) -> tuple[list[TraceFault], str]:
    """The trace's faults and where they came from.

    Args:
        path: a trace directory (with ``fault_trace.json``), a table written by ``derive``, or
            None for the copy shipped in this package.
    """
    if path is None:
        text = resources.files("goodput").joinpath("data", SHIPPED).read_text()
        return _parse_table(text), f"goodput/data/{SHIPPED} (shipped copy)"
    p = Path(path)
    if p.is_dir():
        return _pair(json.loads((p / "fault_trace.json").read_text())), str(p)
    return _parse_table(p.read_text()), str(p)
