"""The shape of rlx/ that docs/architecture.md states: no import cycle anywhere, and each
folder imports only what its rule allows. Imports are read from the source (every import
statement, those inside functions too), so nothing is imported to check them."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RLX = ROOT / "rlx"

# Folder (a module prefix) -> module prefixes its modules may never import, and why.
RULES: dict[str, tuple[tuple[str, ...], str]] = {
    "rlx.node": (
        ("rlx.launchers", "rlx.trainer", "rlx.lint", "rlx.plan", "rlx.cli"),
        "what every node runs stands alone: the client side may change without the nodes",
    ),
    "rlx.recipe": (
        ("rlx.launchers", "rlx.trainer", "rlx.lint", "rlx.plan", "rlx.node", "torch", "ray"),
        "the recipe model is a leaf",
    ),
    "rlx.trainer.learn": (("ray", "rlx.trainer.actors"), "the learner is plain torch"),
    "rlx.trainer.algos": (("ray", "torch.distributed", "rlx.trainer.actors"), "pure math"),
    "rlx.trainer.rollout": (
        ("ray", "rlx.trainer.actors", "rlx.trainer.learn"),
        "engines know no Ray, and take nothing from the learner: what they share is model/",
    ),
    "rlx.trainer.model": (
        (
            "ray",
            "rlx.trainer.learn",
            "rlx.trainer.rollout",
            "rlx.trainer.actors",
            "rlx.trainer.checkpoint",
            "rlx.trainer.algos",
            "rlx.trainer.episodes",
            "rlx.trainer.tasks",
            "rlx.trainer.report",
        ),
        "a transformers model from the inside: the floor learn/ and rollout/ stand on",
    ),
    "rlx.trainer.tasks": (("ray", "rlx.trainer.actors"), "prompts and rewards know no Ray"),
    "rlx.trainer.checkpoint": (("ray", "rlx.trainer.actors"), "checkpoints know no Ray"),
    "rlx.trainer.episodes": (
        ("ray", "rlx.trainer.actors"),
        "episodes drive engines through what the controller hands them, never Ray",
    ),
    "rlx.plan": (("torch", "ray", "transformers", "vllm", "rlx.launchers"), "plans offline"),
    "rlx.lint": (("torch", "ray", "transformers", "vllm"), "lints before any GPU is paid for"),
    "rlx.runs": (("torch", "ray", "rlx.launchers"), "both sides read the run folder"),
    "rlx.procfs": (("rlx",), "a leaf"),
    "rlx.sigterm": (("rlx",), "a leaf"),
    "rlx.owner": (
        ("torch", "ray", "rlx.trainer", "rlx.launchers", "rlx.node"),
        "its watchdog starts at once and knows only /proc",
    ),
    "rlx.errors": (("rlx.",), "a leaf"),
}
# A backend's render.py is pure: its library, processes and the clock stay out of it.
RENDER_FORBIDDEN = ("sky", "dstack", "ray", "subprocess", "time", "os")


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str, modules: set[str]) -> Iterator[str]:
    """Every module `path` imports, anywhere in it; `from pkg import sub` counts as pkg.sub
    where that is a module of the tree."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield full if full in modules else base


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports (a package's own __init__ excluded:
    importing a module always runs its parents, which is no cycle of the code's making)."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        found = set(imports_of(path, name, set(files)))
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One import cycle as a path a -> b -> ... -> a, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycle_under_rlx():
    cycle = find_cycle(import_graph(RLX))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_cycle_is_found_when_there_is_one(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (package / "c.py").write_text("import pkg.a\n")
    assert find_cycle(import_graph(package)) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    (package / "c.py").write_text("import json\n")
    assert find_cycle(import_graph(package)) is None


def _within(module: str, prefix: str) -> bool:
    """module is prefix or below it; a prefix ending in '.' means strictly below."""
    if prefix.endswith("."):
        return module.startswith(prefix)
    return module == prefix or module.startswith(prefix + ".")


def _violations(prefix: str, forbidden: tuple[str, ...], root: Path = RLX) -> list[str]:
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    found = []
    for name, path in files.items():
        if name != prefix and not name.startswith(prefix + "."):
            continue
        for target in imports_of(path, name, set(files)):
            if any(_within(target, f) for f in forbidden):
                found.append(f"{name} imports {target}")
    return found


@pytest.mark.parametrize("prefix", sorted(RULES))
def test_each_folder_imports_what_its_rule_allows(prefix):
    forbidden, why = RULES[prefix]
    assert _violations(prefix, forbidden) == [], why


def test_renderers_are_pure():
    renderers = sorted(RLX.glob("launchers/*/render.py"))
    assert len(renderers) == 5
    for path in renderers:
        name = module_name(path, RLX)
        bad = [t for t in imports_of(path, name, set()) if t.split(".")[0] in RENDER_FORBIDDEN]
        assert bad == [], f"{name} imports {bad}"


def test_a_forbidden_import_is_seen(tmp_path):
    node = tmp_path / "rlx" / "node"
    node.mkdir(parents=True)
    (tmp_path / "rlx" / "__init__.py").write_text("")
    (node / "__init__.py").write_text("")
    (node / "x.py").write_text("def f():\n    from rlx.launchers import spec\n")
    found = _violations("rlx.node", RULES["rlx.node"][0], tmp_path / "rlx")
    assert found == ["rlx.node.x imports rlx.launchers"]


# The attribute through which transformers names a model's attention implementation: read
# only in model/ (traits.py; and set where a model switches to segment attention), and by
# model/'s own tests; everything else asks traits().
ATTENTION_ATTRIBUTE = "_attn_implementation"
READS_ATTENTION_IN = (RLX / "trainer" / "model", ROOT / "tests" / "unit" / "trainer" / "model")


def attention_reads(path: Path) -> int:
    """Places in `path` that name ATTENTION_ATTRIBUTE: `x._attn_implementation`, or
    getattr/hasattr/setattr(x, "_attn_implementation", ...)."""
    count = 0
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Attribute) and node.attr == ATTENTION_ATTRIBUTE) or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == ATTENTION_ATTRIBUTE
        ):
            count += 1
    return count


def test_the_attention_implementation_is_read_in_model_alone():
    found = {
        str(path.relative_to(ROOT)): n
        for folder in ("rlx", "bench", "tests")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if not any(path.is_relative_to(d) for d in READS_ATTENTION_IN)
        and (n := attention_reads(path))
    }
    assert found == {}, "ask rlx.trainer.model.traits instead of reading the config"


def test_an_attention_read_is_counted(tmp_path):
    source = tmp_path / "x.py"
    source.write_text(
        "a = m.config._attn_implementation\n"
        "b = getattr(config, '_attn_implementation', None)\n"
        "c = '_attn_implementation'\n"
    )
    assert attention_reads(source) == 2


def test_every_module_imports():
    """A name moved between modules breaks its importers only when they load; the Ray
    actors' modules load in a worker, far from the unit tier, so load them all here."""
    import importlib
    import pkgutil

    import rlx

    failed = {}
    for module in pkgutil.walk_packages(rlx.__path__, "rlx."):
        if module.name != "rlx.__main__":
            try:
                importlib.import_module(module.name)
            except Exception as exc:  # every failure, named, not just the first
                failed[module.name] = f"{type(exc).__name__}: {exc}"
    assert not failed, failed
