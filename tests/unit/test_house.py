"""The shape of the package, kept by tests: module and function sizes, no import
circles, the engine below the public face, private torch names in one module,
no print in the library.

These read the source as text (ast); nothing is imported or run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

PACKAGE = "dist_checkpointing"
ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / PACKAGE

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
# Modules every layer may import: the ground floor of the house.
GROUND = {
    "errors",
    "mapping",
    "dict_utils",
    "_torch_compat",
    "_shard_geometry",
    "_sharded_base",
    "_factories",
}
# The only module that may name private torch.distributed.checkpoint attributes.
TORCH_COMPAT = f"{PACKAGE}._torch_compat"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, tuple[Path, ast.Module]]:
    return {
        _module_name(p): (p, ast.parse(p.read_text(), str(p)))
        for p in sorted(PACKAGE_DIR.rglob("*.py"))
    }


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> Iterator[tuple[str, int]]:
    """``(imported module of the package, line)`` for every import in ``module``."""
    path, tree = _modules()[module]
    known = _modules()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            if not target.startswith(PACKAGE):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield (sub if sub in known else target), node.lineno


def test_the_package_is_found() -> None:
    assert f"{PACKAGE}.serialization" in _modules()
    assert len(_modules()) > 20


def test_no_module_over_the_limit() -> None:
    too_big = {
        m: p.read_text().count("\n")
        for m, (p, _) in _modules().items()
        if p.read_text().count("\n") > MAX_MODULE_LINES
    }
    assert not too_big, f"modules over {MAX_MODULE_LINES} lines: {too_big}"


def test_no_function_over_the_limit() -> None:
    too_long = []
    for module, (_, tree) in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{module}.{node.name} ({lines} lines)")
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


def _import_graph() -> dict[str, set[str]]:
    return {m: {t for t, _ in _imports(m) if t != m} for m in _modules()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle() -> None:
    cycle = _find_cycle(_import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_planted_circle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_engine_does_not_import_the_face() -> None:
    engine = f"{PACKAGE}.engine"
    allowed = {f"{PACKAGE}.{g}" for g in GROUND}
    upward = [
        f"{module}:{line} imports {target}"
        for module in _modules()
        if module == engine or module.startswith(engine + ".")
        for target, line in _imports(module)
        if not (target == engine or target.startswith(engine + ".") or target in allowed)
    ]
    assert not upward, "engine modules import the public face:\n" + "\n".join(upward)


def test_ground_modules_import_only_the_ground() -> None:
    ground = {f"{PACKAGE}.{g}" for g in GROUND}
    upward = [
        f"{module} imports {target}"
        for module in ground & set(_modules())
        for target, _ in _imports(module)
        if target not in ground and target != PACKAGE
    ]
    assert not upward, upward


def _private_torch_dcp_names(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "torch.distributed.checkpoint"
        ):
            parts = (node.module or "").split(".")
            found += [p for p in parts if p.startswith("_")]
            found += [a.name for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            text = ast.unparse(node)
            if text.startswith("torch.distributed.checkpoint."):
                found.append(text)
    return found


def test_private_torch_names_only_in_the_compat_module() -> None:
    offenders = {
        module: names
        for module, (_, tree) in _modules().items()
        if module != TORCH_COMPAT and (names := _private_torch_dcp_names(tree))
    }
    assert not offenders, offenders


def test_no_print_in_the_library() -> None:
    prints = [
        f"{module}:{node.lineno}"
        for module, (_, tree) in _modules().items()
        if ".cli" not in module and not module.endswith("__main__")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"
    ]
    assert not prints, prints


@pytest.mark.parametrize(
    "module",
    [
        "serialization",
        "mapping",
        "validation",
        "core",
        "dict_utils",
        "utils",
        "state_dict_utils",
        "errors",
        "strategies.base",
        "strategies.torch",
        "strategies.common",
        "strategies.async_utils",
        "strategies.filesystem_async",
        "strategies.state_dict_saver",
        "strategies.fully_parallel",
        "exchange_utils",
        "optimizer",
        "strategies.resharding",
        "strategies.cached_metadata_filesystem_reader",
        "tensor_aware_state_dict",
    ],
)
def test_megatron_module_paths_exist(module: str) -> None:
    assert f"{PACKAGE}.{module}" in _modules()
