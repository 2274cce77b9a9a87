"""The package's import contract: data flows one way (sources -> ops -> runtime -> loader).

Read from the source files (every import statement, including those inside functions and those
under ``if TYPE_CHECKING:``: a cycle only type checkers see is still a cycle a reader has to
untangle), so a forbidden import fails here before anyone has to notice it in review. The layers
of the package and of the runtime's rooms are checked by ``lint-imports`` in ``make lint``
(contracts in ``pyproject.toml``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "zephon"

# Of zephon.ops, the runtime may use only the operator API and the children helpers.
RUNTIME_MAY_USE_OF_OPS = ("zephon.ops.base", "zephon.ops.children")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_of(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name == "zephon" or name.startswith("zephon.")}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        imported = _imports_of(tree, name, path.name == "__init__.py")
        # "from zephon.ops import base" names a module; "from zephon.ops.base import X" does not
        graph[name] = {m for m in imported if m in modules and m != name}
    for path in PACKAGE.glob("_core/*.pyx"):
        text = path.read_text()
        names = re.findall(r"^\s*(?:from|c?import)\s+(zephon[\w.]*)", text, re.M)
        graph[_module_name(path)] = set(names)
    return graph


GRAPH = _graph()


def _violations(rule: str) -> list[str]:
    bad = []
    for module, imports in sorted(GRAPH.items()):
        for target in sorted(imports):
            if _forbidden(rule, module, target):
                bad.append(f"{module} imports {target}")
    return bad


def _forbidden(rule: str, module: str, target: str) -> bool:
    if rule == "core imports nothing of ours above it":
        return module.startswith("zephon._core") and not target.startswith("zephon._core")
    if rule == "sources and ops never import the runtime or the planner":
        return module.startswith(("zephon.sources", "zephon.ops")) and target.startswith(
            ("zephon.runtime", "zephon.planner")
        )
    if rule == "the runtime uses only the operator API and children helpers of ops":
        return (
            module.startswith("zephon.runtime")
            and target.startswith("zephon.ops")
            and not target.startswith(RUNTIME_MAY_USE_OF_OPS)
        )
    raise AssertionError(rule)


@pytest.mark.parametrize(
    "rule",
    [
        "core imports nothing of ours above it",
        "sources and ops never import the runtime or the planner",
        "the runtime uses only the operator API and children helpers of ops",
    ],
)
def test_import_rule(rule: str) -> None:
    assert _violations(rule) == []


def _cycle() -> list[str] | None:
    # Package __init__ modules re-export their children; an edge into a package is an edge into
    # its __init__, which is what Python runs.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(GRAPH):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles() -> None:
    # The top-level package re-exports everything; its submodules importing it is not a cycle
    # of the design, so edges into "zephon" itself are left out.
    for imports in GRAPH.values():
        imports.discard("zephon")
    assert _cycle() is None, " -> ".join(_cycle() or [])


def test_the_graph_sees_the_package() -> None:
    assert "zephon.runtime.loader" in GRAPH
    assert "zephon.plan" in GRAPH["zephon.runtime.loader"]
    assert "zephon._core.chunk_table" in GRAPH["zephon._core.delivery"]
