"""The README's configuration table, generated from ``api/settings.py``: every field of
:class:`api.settings.Settings` as ``FOREWARN_<NAME>``, its default and its docstring.

    .venv/bin/python -m tests.docs.settings_table      # print the table to paste
"""

from __future__ import annotations

import ast
import inspect
import itertools
import re
from typing import Any

from pydantic_core import PydanticUndefined

from api.settings import Settings

__all__ = ["settings_table"]

FACTORY_DEFAULTS = {
    "data_dir": "`./var`",
    "tokens": "none (development: `forewarn-dev-token`)",
    "policy": "see [docs/control.md](docs/control.md)",
}
"""Defaults built by a factory, said in words (the factory's value depends on the machine)."""


def _docstrings() -> dict[str, str]:
    """Field name -> the docstring under it in the class body."""
    tree = ast.parse(inspect.getsource(Settings))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default(name: str, value: Any) -> str:
    if name in FACTORY_DEFAULTS:
        return FACTORY_DEFAULTS[name]
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`" if value else "empty"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return f"`{value:_}`".replace("_", ",")
    return f"`{value}`"


def settings_table() -> str:
    """The Markdown table: variable, default, meaning (one row a field, in class order)."""
    docs = _docstrings()
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        default = field.default if field.default is not PydanticUndefined else None
        meaning = re.sub(r"\s*\|\s*", " / ", docs.get(name, "")).replace("``", "`")
        rows.append(f"| `FOREWARN_{name.upper()}` | {_default(name, default)} | {meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(settings_table())
