"""The typing ratchet: the share of fully annotated functions in `megatron/`, `rollout/` and
`trainer/` never drops.

mypy checks these packages with the strict flags (pyproject.toml); this test measures, per
package, the share of functions whose every parameter (``self``/``cls`` aside) and return are
annotated, and fails if one falls below the floor recorded in ``tests/typing_floors.json`` (all
1.0 now), so a module exempted from the strict flags again cannot quietly lose its annotations.
When a change raises a share, raise its floor:

    python -m tests.test_typing_ratchet --update
"""

import ast
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("megatron", "rollout", "trainer")
FLOORS = os.path.join(ROOT, "tests", "typing_floors.json")


def _annotated(fn: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> bool:
    a = fn.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *[p for p in (a.vararg, a.kwarg) if p is not None]]
    if in_class and params and not any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list):
        params = params[1:]  # self / cls
    if any(p.annotation is None for p in params):
        return False
    # mypy accepts an __init__ without "-> None" once a parameter is annotated
    return fn.returns is not None or (fn.name == "__init__" and bool(params))


def _functions(tree: ast.AST):
    """Every function of a module (nested ones and methods included), with whether a class holds it."""
    stack = [(tree, False)]
    while stack:
        node, in_class = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield child, in_class
                stack.append((child, False))
            else:
                stack.append((child, in_class or isinstance(child, ast.ClassDef)))


def annotated_shares() -> dict[str, float]:
    """Package -> fully annotated functions / functions, over its modules."""
    shares = {}
    for package in PACKAGES:
        total = done = 0
        for dirpath, _, files in os.walk(os.path.join(ROOT, "armor_megatron", package)):
            for name in sorted(f for f in files if f.endswith(".py")):
                with open(os.path.join(dirpath, name)) as f:
                    tree = ast.parse(f.read())
                for fn, in_class in _functions(tree):
                    total += 1
                    done += _annotated(fn, in_class)
        shares[package] = done / total if total else 1.0
    return shares


def test_annotated_share_never_drops():
    with open(FLOORS) as f:
        floors = json.load(f)
    shares = annotated_shares()
    assert set(floors) == set(PACKAGES), f"{FLOORS} must hold a floor for each of {PACKAGES}"
    dropped = {p: f"{shares[p]:.4f} < floor {floors[p]:.4f}" for p in PACKAGES if shares[p] < floors[p]}
    assert not dropped, (
        f"fully annotated functions fell below the floor: {dropped}; annotate the new or changed functions "
        "(the floors only rise: `python -m tests.test_typing_ratchet --update` after raising a share)"
    )


def test_the_measure_counts_what_mypy_calls_annotated():
    tree = ast.parse(
        "def a(x: int) -> int: ...\n"
        "def b(x) -> int: ...\n"
        "def c(x: int): ...\n"
        "class K:\n"
        "    def __init__(self, x: int): ...\n"
        "    def m(self) -> None:\n"
        "        def inner(y): ...\n"
        "    @staticmethod\n"
        "    def s(x) -> None: ...\n"
    )
    got = {fn.name: _annotated(fn, in_class) for fn, in_class in _functions(tree)}
    assert got == {"a": True, "b": False, "c": False, "__init__": True, "m": True, "inner": False, "s": False}


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    with open(FLOORS) as f:
        floors = json.load(f)
    now = annotated_shares()
    raised = {p: max(floors.get(p, 0.0), math.floor(now[p] * 1e4) / 1e4) for p in PACKAGES}
    with open(FLOORS, "w") as f:
        json.dump(raised, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"floors: {raised}")
