"""The package's imports point one way: ops → model → engine → server / cli.

Every module under specmla/ belongs to a layer; a module imports only from its own group (the first
name under specmla: `ops`, `model`, `engine`, ...) or from groups of lower layers. The leaves of the
bottom layer (`ops`, `distributed`, `config`, ...) import nothing of specmla outside themselves.
Imports inside functions count like the others, and no module imports another that imports it back
(inside `ops` too), so no deferred import can hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "specmla"

LAYERS = {
    # the bottom: kernels and operators, the process group, and plain data; none imports another
    "ops": 0, "distributed": 0, "config": 0, "sampling_params": 0, "tokenizer": 0,
    "model": 1,  # the network, its loader and its tensor-parallel sharding
    "engine": 2,  # scheduling, KV pool, speculative decoding, CUDA graphs, the LLM entry point, TP workers
    "server": 3, "bench": 3, "serving_bench": 3,  # serving_bench: a standalone client, importing nothing here
    "tune": 3,  # `specmla tune`: the tables of ops against a model config, the MoE search into them
    "cli": 4,
    "": 5,  # specmla/__init__.py, the package's front door: nothing inside the package imports it
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The specmla module `name` refers to (a module, or the package whose attribute it is)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every specmla module that `module` imports, at module level or inside a function."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import name`: name is a submodule, or an attribute of pkg
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name == "specmla" or name.startswith("specmla."):
                target = _resolve(name, modules)
                if target is not None and target != module:
                    found.add(target)
    return found


def _group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in _modules() if _group(m) not in LAYERS)
    assert not unplaced, "modules in no layer: " + ", ".join(unplaced)


def test_imports_point_down_the_layers():
    wrong = []
    for module, targets in _graph().items():
        group = _group(module)
        for target in sorted(targets):
            other = _group(target)
            if other == group:
                continue
            if group not in LAYERS or other not in LAYERS or LAYERS[other] >= LAYERS[group]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)
