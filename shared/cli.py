"""What every `eyrie` subcommand shares: recipe arguments, overrides, and error lines.

Commands live with their service (each service's `cli.py` registers its own through the
`eyrie.commands` entry points); the arguments they have in common are defined here once, and
so is the one line an operating-system or decoding error becomes at the CLI boundary.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.recipe import Recipe

#: Exit code when stdout's reader closes early: what a shell reports for a command killed by
#: SIGPIPE (128 + 13), so `set -o pipefail` scripts see what they would see from `cat`.
EXIT_BROKEN_PIPE = 141

#: What to do about an OSError, by errno (the file is added by `describe_input_error`).
_ERRNO_HINTS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.ENOENT: "no such file or folder",
    errno.EISDIR: "is a folder, not a file",
    errno.ENOTDIR: "a part of the path is not a folder",
    errno.EMFILE: "too many open files (raise `ulimit -n`)",
}


def positive_seconds(text: str) -> float:
    """The argparse type of a finite number of seconds > 0 (nan, inf, 0, negatives refused).

    Raises:
        argparse.ArgumentTypeError: anything else; argparse prints it and exits 2.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0 (got {text})")
    return value


def add_override_arg(p: argparse.ArgumentParser, example: str = "train.lr=1e-4") -> None:
    """Add `-o/--override KEY=VALUE` (repeatable): dotted recipe overrides, parsed as YAML."""
    p.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"dotted recipe override, e.g. {example} (repeatable)",
    )


def add_recipe_args(p: argparse.ArgumentParser, example: str = "train.lr=1e-4") -> None:
    """Add the positional RECIPE and `-o/--override`."""
    p.add_argument("recipe", help="recipe YAML file")
    add_override_arg(p, example)


def recipe_field_of(recipe: Recipe | None, filename: str) -> str | None:
    """The recipe field whose path holds `filename` (the file itself or a folder above it).

    Looks at `target.path`, `target.tokenizer` and every `datasets[i].path`; a file under
    the data root is named by `EYRIE_DATA`. None when no field points at it.
    """
    from shared.store import data_root

    f = Path(os.path.abspath(os.path.expanduser(filename)))
    fields: list[tuple[str, str]] = []
    if recipe is not None:
        fields.append(("target.path", recipe.target.path))
        if recipe.target.tokenizer:
            fields.append(("target.tokenizer", recipe.target.tokenizer))
        fields += [(f"datasets[{i}].path", d.path) for i, d in enumerate(recipe.datasets) if d.path]
    fields.append(("EYRIE_DATA", str(data_root())))
    for name, value in fields:
        p = Path(os.path.abspath(os.path.expanduser(value)))
        if f == p or p in f.parents:
            return name
    return None


def describe_input_error(err: OSError | UnicodeError, recipe: Recipe | None = None) -> str:
    """One line for an operating-system or decoding error that reached the CLI.

    Names the file (`OSError.filename`) and, when a recipe is loaded, the recipe field that
    points at it (`datasets[0].path: ...`), then what failed and the fix where one is known.
    Shapes: `datasets[0].path: /d/x.json: permission denied`,
    `EYRIE_DATA: /data/runs/r/x.arrow: no space left on the device; ...`.
    """
    if isinstance(err, UnicodeDecodeError):
        return (
            f"input is not UTF-8 text (byte {err.start}: {err.reason}); rerun with -v to see "
            "which file"
        )
    if isinstance(err, UnicodeError):
        return f"text could not be encoded or decoded: {err}; rerun with -v to see where"
    what = _ERRNO_HINTS.get(err.errno or 0, err.strerror or type(err).__name__)
    if err.filename is None:
        if err.errno is None:  # raised by a library with a message only
            return f"{type(err).__name__}: {err}"
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            from shared.store import data_root

            return f"{what} (file not named; stdout, or under EYRIE_DATA={data_root()}?)"
        return f"{what} ({type(err).__name__}, errno {err.errno})"
    name = os.fsdecode(err.filename)
    field = recipe_field_of(recipe, name)
    if field == "EYRIE_DATA" and err.errno in (errno.ENOSPC, errno.EDQUOT):
        what += "; free space or point EYRIE_DATA at a bigger disk"
    return f"{field + ': ' if field else ''}{name}: {what}"


def input_error_exit_code(err: OSError | UnicodeError) -> int:
    """2 when the operator must fix a file, a path or the disk; 1 for other OS errors.

    An `OSError` naming a file, a full disk and undecodable text are input problems that a
    retry cannot fix; a socket error without a file is not.
    """
    if not isinstance(err, OSError) or err.filename is not None or err.errno in _ERRNO_HINTS:
        return 2
    return 1
