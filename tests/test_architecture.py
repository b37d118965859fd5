"""The module picture, enforced: imports between the project's packages run one way only.

    models     <- inference, tasks        (model anatomy and surgery; the runtime; data tasks)
    inference  <- algorithms              (rollouts decode through the runtime)
    tasks      <- algorithms
    algorithms <- trainer                 (the loop drives algorithms through their contract)

No arrow runs back up, nothing but the registry (`algorithms/__init__.py`) imports an algorithm
file (shared machinery lives in the package of its concern), and no module takes part in an
import cycle -- counting imports inside functions, which run just as surely, only later.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

ALLOWED = {  # package -> the project packages its modules may import
    "models": {"models"},
    "inference": {"inference", "models"},
    "tasks": {"tasks", "models"},
    "algorithms": {"algorithms", "models", "inference", "tasks"},
    "trainer": {"trainer", "algorithms", "models", "inference", "tasks"},
}
PACKAGES = set(ALLOWED)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(target: str, modules: dict[str, Path]) -> str:
    """The project module an import names: the longest dotted prefix that is a module."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in modules:
            return name
    return target


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules imported anywhere in the file (top level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import sub` imports the submodule pkg.sub when there is one
            targets = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {_resolve(t, modules) for t in targets if t.split(".")[0] in PACKAGES}
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _algorithm_files() -> set[str]:
    from algorithms import REGISTRY

    return {cls.__module__ for _, cls in REGISTRY.values()}


def test_no_import_runs_up_the_layers():
    bad = [f"{src} imports {dst}" for src, dsts in _graph().items() for dst in dsts
           if dst.split(".")[0] not in ALLOWED[src.split(".")[0]]]
    assert not bad, "\n".join(bad)


def test_only_the_registry_imports_algorithm_files():
    algos = _algorithm_files()
    assert len(algos) >= 6
    bad = [f"{src} imports {dst}" for src, dsts in _graph().items() for dst in dsts & algos
           if src != "algorithms"]
    assert not bad, "shared machinery belongs in the package of its concern:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
])
def test_cycle_finder_by_hand(graph, expected):
    assert _cycles(graph) == expected


def test_checker_sees_function_level_and_submodule_imports(tmp_path):
    modules = {"algorithms": ROOT, "algorithms.losses": ROOT, "trainer.loop": ROOT}
    source = tmp_path / "m.py"
    source.write_text("from algorithms import losses\n\ndef f():\n    from trainer.loop import fit\n")
    assert _imports(source, modules) == {"algorithms.losses", "trainer.loop"}


def test_the_trainer_never_probes_an_algorithm():
    """Capabilities come from the typed contract (algorithms.base.capabilities), resolved once at
    setup: no getattr / hasattr on an algorithm or its config anywhere in trainer/."""
    bad = []
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
                target = ast.unparse(node.args[0]) if node.args else ""
                if "algo" in target:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)
