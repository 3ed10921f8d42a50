"""Print requirement lines for an image build, one per line, for `pip install -r`.

  python requirements.py pyproject PATH            Eyrie's [project] dependencies
  python requirements.py dist NAME [--drop N ...]  an installed distribution's requirements

The images install dependencies in their own layer (cached while only the code changes), and
speculators with `--no-deps` (its torchvision/torchaudio requirements pull a second torch and
it imports neither), so both lists are read here from their one source instead of copied
into the Dockerfiles. Versions come from images/constraints.txt (`pip install -c`).
Requirements that apply only to an extra (`extra == "dev"`) are left out.
"""

import argparse
import importlib.metadata
import re
import sys
import tomllib

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _name(req: str) -> str:
    m = _NAME.match(req)
    if m is None:
        raise SystemExit(f"requirements.py: cannot read a package name from {req!r}")
    return m.group(1).lower().replace("_", "-")


def pyproject_deps(path: str) -> list[str]:
    with open(path, "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def dist_deps(name: str, drop: list[str]) -> list[str]:
    dropped = {d.lower().replace("_", "-") for d in drop}
    reqs = importlib.metadata.requires(name) or []
    return [r for r in reqs if "extra ==" not in r and _name(r) not in dropped]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="source", required=True)
    pp = sub.add_parser("pyproject")
    pp.add_argument("path")
    dp = sub.add_parser("dist")
    dp.add_argument("name")
    dp.add_argument("--drop", nargs="*", default=[])
    args = p.parse_args(argv)
    if args.source == "pyproject":
        lines = pyproject_deps(args.path)
    else:
        lines = dist_deps(args.name, args.drop)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
