"""The package's import structure: subpackages import only downward, and no module imports itself
back through others (no cycle between files). Every import counts, also those inside functions
and under ``TYPE_CHECKING``: a lazy import is still a dependency."""

import ast
import functools
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "armor_megatron"

# Lowest first: a subpackage may import the root's modules and the subpackages listed before it.
LAYERS = (
    "models",  # ModelArch from HF configs
    "data",  # RolloutBatch, prompt datasets
    "algo",  # ARMOR math, pure torch
    "rewards",  # verifiers, pass@k
    "config",  # typed run configs
    "convert",  # HF <-> Megatron rules and the streaming converter
    "launch",  # SLURM plans, node lists, sweeps
    "tasks",  # synthetic task and warm-up for tiny runs
    "rollout",  # engines, weight sync, anchor sampling
    "megatron",  # the only importer of megatron-core
    "trainer",  # the ARMOR loop
    "study",  # research studies: armor-train runs over variants and seeds, read back
    "cli",  # entry points
)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """armor_megatron modules that `path` imports anywhere (``from a import b`` counts a.b when b is a module)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in modules:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate.startswith("armor_megatron") and candidate != name:
                found.add(candidate)
    return found


@functools.cache  # the package's files do not change during a run; read-only for its callers
def import_graph() -> dict[str, frozenset[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: frozenset(imported_modules(path, set(files))) for name, path in files.items()}


def subpackage(module: str) -> str | None:
    """The subpackage holding `module`; None for the root (the package's __init__ and its
    top-level modules, such as ``armor_megatron.registry``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else None


def test_every_subpackage_has_a_layer():
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert subpackages == set(LAYERS)


def test_subpackages_import_only_downward():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = [
        f"{src} -> {dst}"
        for src, targets in import_graph().items()
        for dst in targets
        if subpackage(dst) is not None
        and subpackage(src) is not None
        and subpackage(src) != subpackage(dst)
        and rank[subpackage(dst)] > rank[subpackage(src)]
    ]
    assert not upward, "imports against the layering (see LAYERS):\n" + "\n".join(sorted(upward))


def test_root_modules_import_no_subpackage():
    """Every layer may import the root's modules, so they import nothing above them."""
    upward = [
        f"{src} -> {dst}"
        for src, targets in import_graph().items()
        for dst in targets
        if subpackage(src) is None and subpackage(dst) is not None and src != "armor_megatron"
    ]
    assert not upward, "root modules importing subpackages:\n" + "\n".join(sorted(upward))


def find_cycles(graph: Mapping[str, AbstractSet[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
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
                        cycles.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return cycles


def test_no_import_cycle_between_files():
    assert find_cycles(import_graph()) == []


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_cycle_finder(graph, expected):
    assert sorted(find_cycles(graph)) == expected


def test_lazy_and_relative_imports_count(tmp_path):
    modules = {"armor_megatron.megatron.actor", "armor_megatron.megatron", "armor_megatron.trainer.loop"}
    source = tmp_path / "armor_megatron" / "megatron" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text("def f():\n    from armor_megatron.trainer import loop\nfrom . import actor\n")
    found = imported_modules(source, modules, root=tmp_path)
    assert found == {"armor_megatron.trainer.loop", "armor_megatron.megatron.actor", "armor_megatron.megatron"}


def test_graph_sees_lazy_imports_of_the_package():
    assert "armor_megatron.megatron.actor" in import_graph()["armor_megatron.trainer.run"]  # imported in a function
