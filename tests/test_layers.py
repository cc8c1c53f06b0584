"""The package's layers import downward only, and no module imports itself back in a cycle.

Every `from specdecode... import` counts, at module level, inside functions and under
`TYPE_CHECKING` alike: a type-only import that points upward is still an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import specdecode

ROOT = Path(specdecode.__file__).parent

# Lowest first. A module may import from its own layer and the layers below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "request and plan",
        (
            "specdecode.errors",
            "specdecode.sampling",
            "specdecode.tree",
            "specdecode.verify",
            "specdecode.outputs",
            "specdecode.spec_config",
            "specdecode.kernels",
            "specdecode.layers",
            "specdecode.attention",
            "specdecode.kv_cache",
            "specdecode.models",
            "specdecode.request",
        ),
    ),
    ("drafters", ("specdecode.drafters",)),
    ("engine", ("specdecode.engine",)),
    (
        "entry points",
        (
            "specdecode.llm",
            "specdecode.serving",
            "specdecode.distributed",
            "specdecode.bench",
            "specdecode.train",
            "specdecode.cli",
            "specdecode",
        ),
    ),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The specdecode modules `path` imports (a `from X import name` counts as X.name when that
    is a module of ours, else as X)."""
    known = {module_name(p) for p in ROOT.rglob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("specdecode")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdecode"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
    return found


def layer_of(module: str) -> int:
    """The layer of `module`: that of the longest prefix listed."""
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    assert best >= 0, f"{module} is in no layer: add it to LAYERS"
    return best


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) - {module_name(p)} for p in ROOT.rglob("*.py")}


def test_every_import_points_downward() -> None:
    upward = []
    for module, deps in graph().items():
        for dep in deps:
            if layer_of(dep) > layer_of(module):
                upward.append(
                    f"{module} ({LAYERS[layer_of(module)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})"
                )
    assert not upward, "\n".join(sorted(upward))


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle met in a depth-first walk, as the modules along it."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(edges.get(module, ())):
            if dep not in edges or dep == "specdecode":
                continue  # the package root re-exports the API; nothing inside imports it
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    return cycles


def test_no_import_cycles() -> None:
    cycles = find_cycles(graph())
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_see_a_planted_upward_import(tmp_path: Path) -> None:
    """The scan finds imports in functions and under TYPE_CHECKING, and ranks them."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from specdecode.engine.llm_engine import LLMEngine\n"
        "def f():\n    from specdecode.llm import LLM\n"
    )
    found = imports(planted)
    assert found == {"specdecode.engine.llm_engine", "specdecode.llm"}
    assert layer_of("specdecode.engine.llm_engine") > layer_of("specdecode.drafters.eagle")
    assert layer_of("specdecode.llm") > layer_of("specdecode.engine.llm_engine")
    assert layer_of("specdecode.request") < layer_of("specdecode.drafters.base")
    planted_cycle = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(planted_cycle) == [["a", "b", "c", "a"]]


def test_compiled_kernels_are_reached_only_through_the_boundary() -> None:
    """ctypes is imported by the kernels package alone; outside it, nothing imports a kernel
    implementation (`specdecode.kernels.cpu_isa`, `.cpu`, `.reference`) but the interface, and
    drafters import no kernels at all: they read the model's layers and LM head."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        module = module_name(path)
        if module.startswith("specdecode.kernels"):
            continue
        tree = ast.parse(path.read_text())
        plain = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        if "ctypes" in plain:
            offenders.append(f"{module} imports ctypes")
        for dep in imports(path):
            if dep.startswith("specdecode.kernels.") and dep not in ("specdecode.kernels.base",):
                offenders.append(f"{module} imports {dep}")
            if module.startswith("specdecode.drafters") and dep.startswith("specdecode.kernels"):
                offenders.append(f"drafter {module} imports {dep}")
    assert not offenders, "\n".join(sorted(offenders))
