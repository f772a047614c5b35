from __future__ import annotations

import subprocess
import sys

from forewarn.cli import COMMANDS, main


def test_help_lists_every_command(capsys) -> None:  # type: ignore[no-untyped-def]
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_python_m_serve_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "forewarn", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "--database-url" in out


def test_unknown_command_fails() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "forewarn", "teleport"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
