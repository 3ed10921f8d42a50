"""Print the README's recipe reference (a Markdown table per section) from the schema.

Usage: .venv/bin/python scripts/recipe_reference.py > /tmp/ref.md, then paste it between the
README's `<!-- recipe-reference -->` markers. tests/test_docs.py checks every field is named.
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.recipe import Recipe  # noqa: E402


def _sub(ann):
    for t in (ann, *typing.get_args(ann)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{value!r}`" if value not in ("", None) else f"`{value}`"


def table(model: type[BaseModel], prefix: str) -> list[str]:
    title = prefix.rstrip(".") or "top level"
    lines = [f"\n**`{title}`**\n", "| key | default | meaning |", "|---|---|---|"]
    subs = []
    for name, f in model.model_fields.items():
        path = f"{prefix}{name}"
        lines.append(f"| `{path}` | {_default(f)} | {f.description} |")
        sub = _sub(f.annotation)
        if sub is not None:
            subs.append((sub, f"{path}."))
    for sub, p in subs:
        lines += table(sub, p)
    return lines


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print("\n".join(table(Recipe, "")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
