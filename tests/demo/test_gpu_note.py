"""Where a GPU vendor library is present, the demo names the collector command for it."""

from __future__ import annotations

import argparse
import sys
import types

import pytest

from collector.cli import configure
from demo.cli import _gpu_note


@pytest.mark.parametrize("module", ["pynvml", "amdsmi"])
def test_the_offered_collector_command_parses(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("pynvml", "amdsmi"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails: not installed
    monkeypatch.setitem(sys.modules, module, types.ModuleType(module))
    note = _gpu_note()
    assert note is not None and module in note
    command = note.split("with\n", 1)[1].split()
    assert command[:2] == ["forewarn", "collect"]
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(command[2:])
    assert args.source in ("nvml", "amd")
