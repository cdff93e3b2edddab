"""The package's architecture, checked from its source: no import cycle, no private name
used outside its module, Dask's internals in one module, a pure core, and a layout the
README describes.

Every import counts, wherever it stands (module level, inside a function, under
``TYPE_CHECKING``): a cycle hidden in a function is still a cycle for a reader.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "msd_dask"
README = PACKAGE.parent / "README.md"

#: the one module allowed to touch Dask's private internals
DASK_INTERNALS = "msd_dask.dask_internals"
#: attributes of Dask objects that are internals without a leading underscore: the
#: scheduler's RPC handler tables and the queue extension's refcounts
#: a worker's actor table
DASK_INTERNAL_ATTRIBUTES = {"handlers", "stream_handlers", "client_refcount"}
#: what the pure core may import from msd_dask besides itself
CORE_MAY_IMPORT = {"msd_dask.errors"}
#: third-party packages the pure core must not import (Dask, storage)
NOT_IN_CORE = {"dask", "distributed", "fsspec", "s3fs", "pyarrow", "tokenizers", "torch"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(encoding="utf-8"), str(p))
            for p in sorted(PACKAGE.rglob("*.py"))}


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    is_package = (PACKAGE.parent / module.replace(".", "/") / "__init__.py").exists()
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str, tree: ast.Module) -> Iterator[tuple[str, list[str], int]]:
    """``(imported module, names taken from it, line)`` for every import in ``module``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            yield _absolute(module, node), [a.name for a in node.names], node.lineno


def internal_edges(module: str, mods: dict[str, ast.Module]) -> set[str]:
    """The msd_dask modules ``module`` imports (a name that is a submodule counts as that module)."""
    out = set()
    for target, names, _ in imports(module, mods[module]):
        if not target.startswith("msd_dask"):
            continue
        subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in mods]
        out.update(subs or [target])
        if subs and len(subs) < len(names):
            out.add(target)
    out.discard(module)
    return out


def cycles(mods: dict[str, ast.Module]) -> list[list[str]]:
    """The import cycles among ``mods`` (strongly connected components of two or more)."""
    graph = {m: internal_edges(m, mods) & set(mods) for m in mods}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


def test_no_import_cycle() -> None:
    assert cycles(modules()) == []


def _private_names_defined(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, globals, attributes it assigns."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(mods: dict[str, ast.Module]) -> list[str]:
    """Every use of a private name outside the module that defines it.

    ``obj._name`` counts when ``_name`` is not defined in the module using it: if another
    msd_dask module defines it, that module's private state is reached into; if none
    does, it is a library's private name, allowed only in :data:`DASK_INTERNALS`.
    """
    defined = {m: _private_names_defined(tree) for m, tree in mods.items()}
    everywhere = set().union(*defined.values())
    found = []
    for module, tree in mods.items():
        for target, names, line in imports(module, tree):
            if target.startswith("msd_dask") and target != module:
                found += [f"{module}:{line} imports {n} from {target}" for n in names if _private(n)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                name, line = node.attr, node.lineno
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                name, line = node.args[1].value, node.lineno
            else:
                continue
            if name in DASK_INTERNAL_ATTRIBUTES and module != DASK_INTERNALS:
                found.append(f"{module}:{line} uses {name}, one of Dask's internals "
                             f"(they belong in {DASK_INTERNALS})")
                continue
            if not _private(name) or name in defined[module]:
                continue
            if name in everywhere:
                found.append(f"{module}:{line} uses {name} of another msd_dask module")
            elif module != DASK_INTERNALS:
                found.append(f"{module}:{line} uses {name}, a private name of a library "
                             f"(Dask's internals belong in {DASK_INTERNALS})")
    return found


def test_no_private_name_used_outside_its_module() -> None:
    assert private_uses(modules()) == []


def test_each_dask_internal_says_what_it_relies_on() -> None:
    tree = modules()[DASK_INTERNALS]
    functions = [n for n in tree.body
                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and not _private(n.name)]
    assert functions
    for fn in functions:
        assert "Relies on" in (ast.get_docstring(fn) or ""), f"{fn.name} does not say what it relies on"


def test_the_checks_see_what_they_forbid() -> None:
    """A cycle, a private use and a library's private name planted in a copy of the package are found."""
    planted = dict(modules())
    planted["msd_dask.core.units"] = ast.parse(
        "def f():\n    from msd_dask.core.stream import SourceStream\n")
    planted["msd_dask.core.mixing"] = ast.parse("def f(p):\n    return p._recent, p._address\n")
    planted["msd_dask.roles.x"] = ast.parse("from msd_dask.roles.planner import _private_thing\n")
    assert ["msd_dask.core.stream", "msd_dask.core.units"] in cycles(planted)
    uses = private_uses(planted)
    assert any(u.startswith("msd_dask.core.mixing:2 uses _recent of another") for u in uses), uses
    assert any(u.startswith("msd_dask.core.mixing:2 uses _address, a private name of a library")
               for u in uses), uses
    assert "msd_dask.roles.x:1 imports _private_thing from msd_dask.roles.planner" in uses


@pytest.mark.parametrize("module", sorted(m for m in modules() if m.startswith("msd_dask.core")))
def test_core_imports_no_dask_no_storage(module: str) -> None:
    for target, _, line in imports(module, modules()[module]):
        top = target.split(".")[0]
        assert top not in NOT_IN_CORE, f"{module}:{line} imports {target}"
        if top == "msd_dask":
            assert target.startswith("msd_dask.core") or target in CORE_MAY_IMPORT, \
                f"{module}:{line} imports {target}, outside the pure core"


def test_importing_the_core_loads_no_dask_and_no_fsspec() -> None:
    core = sorted(m for m in modules() if m.startswith("msd_dask.core"))
    code = ("import importlib, sys\n"
            f"for m in {core!r}:\n"
            "    importlib.import_module(m)\n"
            "print(sorted({k.split('.')[0] for k in sys.modules} & "
            f"set({sorted(NOT_IN_CORE)!r})))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]"


def test_readme_layout_table_matches_the_folder_listing() -> None:
    """Every package and top-level module of msd_dask/ is in the README's layout table, and
    every msd_dask path the table names exists."""
    text = README.read_text(encoding="utf-8")
    layout = text[text.index("## Layout"):]
    layout = layout[: layout.index("\n## ", 4)] if "\n## " in layout[4:] else layout
    named = set(re.findall(r"`(msd_dask/[\w/.]*)`", layout))
    listing = {f"msd_dask/{p.name}/" if p.is_dir() else f"msd_dask/{p.name}"
               for p in PACKAGE.iterdir()
               if not p.name.startswith((".", "__")) and (p.is_dir() or p.suffix == ".py")}
    assert listing - named == set(), "in msd_dask/ but not in the README's layout table"
    missing = {n for n in named if not (PACKAGE.parent / n).exists()}
    assert missing == set(), "in the README's layout table but not in msd_dask/"


def test_readme_layout_names_every_module_of_each_folder() -> None:
    """A folder's row in the README's layout table names each of its modules."""
    text = README.read_text(encoding="utf-8")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(msd_dask/\w+/)` \| (.*)\|$", text, re.M)}
    for folder, row in rows.items():
        names = {p.stem for p in (PACKAGE.parent / folder).glob("*.py") if p.stem != "__init__"}
        assert {n for n in names if f"`{n}`" not in row} == set(), f"{folder} row misses these"



def test_no_two_test_modules_share_a_name() -> None:
    """pytest imports test modules by their basename (rootdir-relative, no packages): a unit
    test named as an integration one failed the whole run at collection ("import file
    mismatch"), in CI only, where both kinds run together."""
    tests = PACKAGE.parent / "tests"
    seen: dict[str, Path] = {}
    twice = []
    for path in sorted(tests.rglob("test_*.py")):
        if path.name in seen:
            twice.append(f"{seen[path.name].relative_to(tests)} and {path.relative_to(tests)}")
        seen.setdefault(path.name, path)
    assert not twice, twice
