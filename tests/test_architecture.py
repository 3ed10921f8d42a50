"""The shape of the code: services meet only in shared/, run-store paths live in one module.

Computed from the source with `ast`, independently of the modules' own claims:
- every import (top-level or inside a function) and every `importlib.import_module` /
  entry-point string of `services/<a>/` naming `services.<b>` (b != a) is a violation;
- `shared/` imports no service (a string naming a service module, such as the KV connector
  vLLM loads by path, is configuration, not an import);
- no service builds a run-store path by hand: no `.root` / `.stage_dir(` on a store, and
  no string literal naming a run-store file or folder (`shard-`, `manifest-`, `plan.json`,
  `d2t.npy`, ...). Those live in `shared/artifacts.py` only.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ROOT / "services"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, including function-local ones."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            out.append((node.lineno, str(node.args[0].value)))
    return out


def _service_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "services" else None


def test_no_service_imports_another():
    bad = []
    for path in sorted(SERVICES.rglob("*.py")):
        own = path.relative_to(SERVICES).parts[0]
        for line, mod in _imports(path):
            other = _service_of(mod)
            if other is not None and other != own:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "services meet only in shared/:\n" + "\n".join(bad)


def test_shared_imports_no_service():
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {mod}"
        for path in sorted((ROOT / "shared").rglob("*.py"))
        for line, mod in _imports(path)
        if mod.split(".")[0] == "services"
    ]
    assert not bad, "\n".join(bad)


def test_scripts_and_services_import_nothing_from_tests():
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {mod}"
        for folder in ("services", "shared", "scripts", "images")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, mod in _imports(path)
        if mod.split(".")[0] == "tests"
    ]
    assert not bad, "\n".join(bad)


def test_entry_points_name_modules_of_one_service_each():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    stages = project["entry-points"]["eyrie.stages"]
    commands = project["entry-points"]["eyrie.commands"]
    for target in [*stages.values(), *commands.values()]:
        module = target.split(":")[0]
        assert _service_of(module) is not None, target
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), target


#: String literals that name run-store files or folders (their one home: shared/artifacts.py).
_RUN_STORE_NAMES = re.compile(
    r"(^|/)(shard-|manifest-|plan\.json|selection\.npy|index-\d|keep\.json|split\.json|"
    r"heldout\.jsonl|d2t\.npy|t2d\.npy|token_freq\.|coverage\.json|hidden_states/|hs_|"
    r"meta\.json|metrics\.jsonl|best\.json|lint\.json|export\.json|report\.json|"
    r"report\.md|turn1-answers|epoch-\d|step-latest|checkpoints/|vllm-hidden-states)"
)


def path_violations(source: str, where: str) -> list[str]:
    """Hand-built run-store paths in one source file.

    A store's `.root` shown inside an f-string (a message naming the run folder) builds no
    path; docstrings are documentation.
    """
    tree = ast.parse(source, where)
    parents = {id(c): n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("root", "stage_dir"):
            owner = ast.unparse(node.value)
            up = parents.get(id(node))
            while isinstance(up, ast.Attribute):  # `store.root.parent` shown is shown too
                up = parents.get(id(up))
            shown = isinstance(up, ast.FormattedValue)
            if "store" in owner and not shown:
                bad.append(f"{where}:{node.lineno} uses {owner}.{node.attr}")
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and _RUN_STORE_NAMES.search(node.value)
        ):
            bad.append(f"{where}:{node.lineno} names {node.value!r}")
    return bad


def test_no_service_builds_a_run_store_path():
    bad = [
        v
        for path in sorted(SERVICES.rglob("*.py"))
        for v in path_violations(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not bad, "run-store paths come from shared.artifacts.RunStore:\n" + "\n".join(bad)


def test_the_path_check_sees_a_hand_built_path():
    """The check above is not vacuous: it flags each form it forbids, and only those."""
    src = (
        'p = store.root / "vocab"\n'
        'q = out / f"shard-{n:05d}.jsonl"\n'
        'r = self.store.stage_dir("train") / "best.json"\n'
        'print(f"run at {store.root}")\n'
    )
    got = sorted(path_violations(src, "x.py"))
    assert got == [
        "x.py:1 uses store.root",
        "x.py:2 names 'shard-'",
        "x.py:3 names 'best.json'",
        "x.py:3 uses self.store.stage_dir",
    ], got
