"""The shape of src/pepsi (issue 35): small modules, small folders, no import circle,
the AMQP layers importing one way, and docs/architecture.md naming what is there.

Static: the sources are parsed with `ast`, nothing of Pepsi is imported.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
PACKAGE = SRC / "pepsi"
ARCHITECTURE = REPO / "docs" / "architecture.md"

OUTSIDE_PACKAGE = frozenset({"src", "tests", "docs", "bench", "scripts"})  # named from the repo

MAX_LINES = 400
MAX_MODULES_PER_FOLDER = 12

# Which subpackages of pepsi.amqp each may import (issue 35: broker → model → wire,
# and the connections a layer of their own: broker → session → auth → wire).
AMQP_LAYERS: dict[str, frozenset[str]] = {
    "wire": frozenset(),
    "model": frozenset({"wire"}),
    "auth": frozenset({"wire"}),
    "session": frozenset({"auth", "wire"}),
    "broker": frozenset({"session", "model", "auth", "wire"}),
}

# Every requirement of SPEC.md (shared/SPEC.md, not in this repository) the architecture
# page must place in a module. Written out because CI runs on a fresh clone.
SPEC_IDS: tuple[str, ...] = (
    *(f"R-{n}" for n in range(1, 12)),
    *(f"P-{n}" for n in range(1, 16)),
    *(f"W-{n}" for n in range(1, 11)),
    *(f"Q-{n}" for n in range(1, 4)),
    *(f"A-{n}" for n in range(1, 6)),
    *(f"M-{n}" for n in range(1, 7)),
)


# -- the modules and their imports ---------------------------------------------------------


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _run_at_import(body: list[ast.stmt], typing: bool = False) -> Iterator[ast.stmt]:
    """The statements of `body` Python runs when the module is imported: not the bodies
    of functions, nor what `if TYPE_CHECKING:` guards (its `else` does run), unless
    `typing` (what the type checker reads too)."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        yield node
        if isinstance(node, ast.If):
            if typing or not _is_type_checking(node.test):
                yield from _run_at_import(node.body, typing)
            yield from _run_at_import(node.orelse, typing)
        elif isinstance(node, ast.Try | ast.TryStar):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _run_at_import(block, typing)
            for handler in node.handlers:
                yield from _run_at_import(handler.body, typing)
        elif isinstance(node, ast.With | ast.For | ast.While | ast.ClassDef):
            yield from _run_at_import(node.body, typing)


def imports(
    tree: ast.Module,
    name: str,
    *,
    package: bool,
    known: Iterable[str],
    everywhere: bool = False,
    typing: bool = False,
) -> set[str]:
    """The modules of pepsi that module `name` (parsed: `tree`) imports at module level
    (with `typing`, under `if TYPE_CHECKING:` too), or `everywhere` (in functions too).

    `from a.b import c` is an import of `a.b.c` when that is a module, else of `a.b`.
    The parent packages Python runs on the way are not counted: every module would
    otherwise import `pepsi`, whose `__init__` imports some of them back.
    """
    known = set(known)
    here = name if package else name.rpartition(".")[0]
    nodes = ast.walk(tree) if everywhere else _run_at_import(tree.body, typing)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = here.split(".")
                base = parts[: len(parts) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            for alias in node.names:
                target = f"{origin}.{alias.name}"
                found.add(target if target in known else origin)
    return {m for m in found if m in known and m != name}


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


@functools.cache
def import_graph(*, everywhere: bool = False, typing: bool = False) -> dict[str, set[str]]:
    known = modules()
    return {
        name: imports(
            parsed(path),
            name,
            package=path.name == "__init__.py",
            known=known,
            everywhere=everywhere,
            typing=typing,
        )
        for name, path in known.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def a_cycle(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One closed path through `component`, for the failure message."""
    members = set(component)
    path = [component[0]]
    seen = {component[0]: 0}
    while True:
        nxt = min(graph[path[-1]] & members)
        if nxt in seen:
            return [*path[seen[nxt] :], nxt]
        seen[nxt] = len(path)
        path.append(nxt)


# -- size ----------------------------------------------------------------------------------


def test_no_module_is_over_400_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them): " + ", ".join(
        f"{path} ({n})" for path, n in sorted(long.items(), key=lambda item: -item[1])
    )


def test_no_folder_holds_more_than_12_modules() -> None:
    crowded = {
        str(folder.relative_to(SRC)) + "/": n
        for folder in [PACKAGE, *(d for d in PACKAGE.rglob("*") if d.is_dir())]
        if (n := len(list(folder.glob("*.py")))) > MAX_MODULES_PER_FOLDER
    }
    assert not crowded, (
        f"folders with more than {MAX_MODULES_PER_FOLDER} modules (__init__.py counted): "
        + ", ".join(f"{folder} ({n})" for folder, n in sorted(crowded.items()))
    )


# -- imports -------------------------------------------------------------------------------


def test_the_circle_finder_sees_module_level_imports_only() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import pepsi.errors\n"
        "from pepsi.amqp import wire\n"
        "from pepsi.config import Config\n"
        "from . import backoff\n"
        "if TYPE_CHECKING:\n    from pepsi import stage\n"
        "else:\n    from pepsi import durations\n"
        "try:\n    from pepsi.db import queries\nexcept ImportError:\n    pass\n"
        "def f():\n    from pepsi import cli\n"
        "class C:\n    from pepsi import terminal\n"
    )
    assert imports(ast.parse(source), "pepsi.db.probe", package=False, known=modules()) == {
        "pepsi.errors",
        "pepsi.amqp.wire",
        "pepsi.config",
        "pepsi.db.backoff",
        "pepsi.durations",
        "pepsi.db.queries",
        "pepsi.terminal",
    }
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert a_cycle(["a", "b", "c"], graph) == ["a", "b", "c", "a"]


def test_no_import_circle() -> None:
    # imports for the type checker count too: a circle of annotations is still two
    # modules that cannot be read one without the other
    graph = import_graph(typing=True)
    found = circles(graph)
    assert not found, "import circles (module-level imports, typing too):\n" + "\n".join(
        " → ".join(a_cycle(component, graph)) for component in found
    )


def test_the_amqp_layers_import_one_way() -> None:
    # Every import counts here, in functions and for type checking too: a layer that
    # knows a higher one is wrong however late it imports it.
    wrong = []
    for module, targets in sorted(import_graph(everywhere=True).items()):
        if not module.startswith("pepsi.amqp."):
            continue
        layer = module.split(".")[2]
        allowed = AMQP_LAYERS.get(layer)
        if allowed is None:
            wrong.append(f"{module}: pepsi.amqp.{layer} is none of {sorted(AMQP_LAYERS)}")
            continue
        wrong.extend(
            f"{module} → {target}"
            for target in sorted(targets)
            if target.startswith("pepsi.amqp.")
            and (other := target.split(".")[2]) != layer
            and other not in allowed
        )
    assert not wrong, (
        "pepsi.amqp's layers import one way (broker → session → auth → wire, "
        "broker → model → wire); these do not:\n" + "\n".join(wrong)
    )


def test_dispatch_and_worker_know_each_other_only_by_the_protocol() -> None:
    graph = import_graph(everywhere=True)
    crossing = [
        f"{module} → {target}"
        for module, targets in sorted(graph.items())
        for mine, theirs in (("pepsi.dispatch", "pepsi.worker"), ("pepsi.worker", "pepsi.dispatch"))
        if module == mine or module.startswith(f"{mine}.")
        for target in sorted(targets)
        if target == theirs or target.startswith(f"{theirs}.")
    ]
    assert not crossing, "dispatch and worker meet in pepsi.protocol only:\n" + "\n".join(crossing)


# -- docs/architecture.md ------------------------------------------------------------------


def test_the_architecture_page_names_every_top_level_package_and_module() -> None:
    text = ARCHITECTURE.read_text()
    tops = sorted(
        f"{p.name}/" if p.is_dir() else p.name
        for p in PACKAGE.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"
    )
    missing = [top for top in tops if f"`{top}`" not in text]
    assert not missing, (
        f"docs/architecture.md does not name these parts of src/pepsi (as `name/` or "
        f"`name.py`): {missing}"
    )


def test_the_architecture_page_names_only_paths_that_exist() -> None:
    # Paths are relative to src/pepsi (`dispatch/services/claimer.py`), or to the
    # repository for the few outside it (`tests/unit/test_pools.py`).
    text = ARCHITECTURE.read_text()
    named = set(re.findall(r"`([\w./-]+(?:\.py|\.sql|/))`", text))
    stale = sorted(
        path
        for path in named
        if not (PACKAGE / path).exists()
        and not (path.split("/")[0] in OUTSIDE_PACKAGE and (REPO / path).exists())
    )
    assert not stale, (
        f"docs/architecture.md names paths that are not in src/pepsi (a module renamed, "
        f"moved or split?): {stale}"
    )


def test_the_architecture_page_places_every_spec_requirement() -> None:
    # A row of the table "SPEC id → module(s)": `| R-1 | what | `module.py`, … |`.
    rows = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^\| ([A-Z]-\d+) \|(.*)$", ARCHITECTURE.read_text(), re.M)
    }
    missing = [i for i in SPEC_IDS if i not in rows]
    assert not missing, f"docs/architecture.md's SPEC table has no row for {missing}"
    placeless = [i for i in SPEC_IDS if not re.search(r"`[\w./-]+(?:\.py|\.sql|/)`", rows[i])]
    assert not placeless, f"docs/architecture.md's SPEC rows name no module for {placeless}"
