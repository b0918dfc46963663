"""Counts that show the trainer's floor plan, for any checkout: functions over 60 lines, the
largest class, the places that read a model's attention implementation, the switches on
the rollout engine's kind outside rlx/trainer/rollout/, and the planner runs per start-up
(bench/planner_runs.py, run against the checkout).

    python bench/floor_counts.py [CHECKOUT]   (default: this one)

A function's lines run from its `def` (decorators left out) to its last line, docstring
included; a nested function counts once, inside its parent and on its own."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

LONG = 60
ENGINE_NAMES = ("engine", "engine_kind")  # names that hold "hf" | "vllm"
ENGINE_KINDS = ("hf", "vllm")
ENGINE_CLASSES = ("HFEngine", "VLLMEngine")


def sources(root: Path) -> list[tuple[Path, ast.Module]]:
    found = []
    for path in sorted((root / "rlx").rglob("*.py")):
        try:
            found.append((path, ast.parse(path.read_text(), str(path))))
        except SyntaxError:
            continue
    return found


def span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]


def qualified(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """(Class.function or function, node) for every function and class, nested ones too."""
    named: list[tuple[str, ast.AST]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                named.append((name, child))
                walk(child, f"{name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return named


def reads_attention(tree: ast.Module) -> list[int]:
    name = "_attn_implementation"
    lines = set()
    for node in ast.walk(tree):
        attribute = isinstance(node, ast.Attribute) and node.attr == name
        if attribute or (isinstance(node, ast.Constant) and node.value == name):
            lines.add(node.lineno)
    return sorted(lines)


def names_engine(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ENGINE_NAMES
    return isinstance(node, ast.Attribute) and node.attr in ENGINE_NAMES


def engine_switches(tree: ast.Module) -> list[int]:
    """`x.engine == "vllm"`-like comparisons and isinstance(..., HFEngine | VLLMEngine)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            kinds = [s for s in sides if isinstance(s, ast.Constant) and s.value in ENGINE_KINDS]
            if kinds and any(names_engine(s) for s in sides):
                lines.add(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
        ):
            classes = ast.walk(node.args[1])
            if any(isinstance(c, ast.Name) and c.id in ENGINE_CLASSES for c in classes):
                lines.add(node.lineno)
    return sorted(lines)


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else Path(__file__).resolve().parent.parent).resolve()
    long_ones: list[tuple[int, str, str]] = []
    classes: list[tuple[int, str, str]] = []
    attention: list[str] = []
    switches: list[str] = []
    rollout = root / "rlx" / "trainer" / "rollout"
    for path, tree in sources(root):
        where = str(path.relative_to(root))
        for name, node in qualified(tree):
            if isinstance(node, ast.ClassDef):
                classes.append((span(node), name, where))
            elif span(node) > LONG:
                long_ones.append((span(node), name, where))
        attention += [f"{where}:{line}" for line in reads_attention(tree)]
        if rollout not in path.parents:
            switches += [f"{where}:{line}" for line in engine_switches(tree)]
    print(f"functions over {LONG} lines: {len(long_ones)}")
    for lines, name, where in sorted(long_ones, reverse=True):
        print(f"  {lines:4d}  {name:45s} {where}")
    lines, name, where = max(classes)
    print(f"largest class: {name} ({lines} lines, {where})")
    print(f"places that read _attn_implementation: {len(attention)}")
    for place in attention:
        print(f"  {place}")
    print(f"engine-kind switches outside rlx/trainer/rollout/: {len(switches)}")
    for place in switches:
        print(f"  {place}")
    runs = Path(__file__).resolve().parent / "planner_runs.py"
    env = {**os.environ, "PYTHONPATH": str(root)}
    counted = subprocess.run(
        [sys.executable, str(runs), str(root)], env=env, capture_output=True, text=True
    )
    print(counted.stdout.strip() or f"planner runs per start-up: not counted ({counted.stderr})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
