"""The Xid catalog: what each NVIDIA Xid code means and how serious it is.

Loaded from ``collector/xid_catalog.tsv`` (shipped with the package): NVIDIA's mnemonic and
recommended actions per code, plus Forewarn's own short description, a class and a
hardware-fatal flag. The collector labels Xid events with it and the predictor counts Xids by
class, so both read the same table.

Classes: ``application`` (13, 31, 43, 45: the job's own fault, the GPU is fine — never a
reason to migrate on its own), ``memory``, ``interconnect`` (NVLink, C2C), ``bus`` (PCIe,
79), ``firmware`` (GSP, PMU, InfoROM), ``thermal`` and ``other``.

Example::

    >>> from collector.xid import lookup
    >>> info = lookup(79)
    >>> info.xid_class, info.hardware_fatal
    (<XidClass.BUS: 'bus'>, True)
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from pathlib import Path

__all__ = ["CATALOG_PATH", "XidClass", "XidInfo", "catalog", "describe", "lookup"]

CATALOG_PATH = Path(__file__).with_name("xid_catalog.tsv")


class XidClass(StrEnum):
    APPLICATION = "application"
    MEMORY = "memory"
    INTERCONNECT = "interconnect"
    BUS = "bus"
    FIRMWARE = "firmware"
    THERMAL = "thermal"
    OTHER = "other"


@dataclass(frozen=True)
class XidInfo:
    """One row of the catalog."""

    code: int
    mnemonic: str
    xid_class: XidClass
    hardware_fatal: bool
    """The GPU (not the job) is broken: the work on it is lost until a reset or repair."""
    immediate_action: str
    """NVIDIA's first resolution bucket: RESTART_APP, RESET_GPU, RESTART_BM, …"""
    investigatory_action: str
    description: str
    known: bool = True


@lru_cache(maxsize=4)
def catalog(path: Path = CATALOG_PATH) -> dict[int, XidInfo]:
    """Every code of the catalog at ``path`` (comment lines start with ``#``)."""
    with open(path, encoding="utf-8", newline="") as fh:
        lines = [line for line in fh if not line.startswith("#")]
    out: dict[int, XidInfo] = {}
    for row in csv.DictReader(lines, delimiter="\t"):
        code = int(row["xid"])
        out[code] = XidInfo(
            code=code,
            mnemonic=row["mnemonic"],
            xid_class=XidClass(row["class"]),
            hardware_fatal=row["hardware_fatal"] == "1",
            immediate_action=row["immediate_action"],
            investigatory_action=row["investigatory_action"],
            description=row["description"],
        )
    return out


def lookup(code: int) -> XidInfo:
    """The catalog entry of ``code``; an unknown code gets a neutral ``other`` entry."""
    info = catalog().get(code)
    if info is not None:
        return info
    return XidInfo(
        code=code,
        mnemonic="UNKNOWN",
        xid_class=XidClass.OTHER,
        hardware_fatal=False,
        immediate_action="",
        investigatory_action="",
        description=f"Xid {code} is not in the catalog (newer driver?).",
        known=False,
    )


def describe(code: int, detail: str | None = None) -> str:
    """A one-line event message: ``Xid 79 (bus, fatal): <description> [<detail>]``."""
    info = lookup(code)
    fatal = ", fatal" if info.hardware_fatal else ""
    text = f"Xid {code} ({info.xid_class}{fatal}): {info.description}"
    if detail:
        text = f"{text} [{detail.strip()}]"
    return text[:2000]
