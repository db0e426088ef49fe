"""No import circle in areal/: every import counts, those inside functions and under
TYPE_CHECKING included, so a seam (a Protocol, a registry) never imports what it declares.
Plugins found by name (tasks, inference and trainer backends) are imported with importlib
and add no edge: the registry depends on nothing of theirs."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the areal modules it imports (a package counts as its __init__)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package_name = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package_name.split(".")[: len(package_name.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for a in node.names:  # `from pkg import module` imports pkg.module
                    full = f"{base}.{a.name}"
                    targets.add(full if full in modules else known(base))
        graph[name] = {t for t in targets if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """areal's folders (areal/X/, subfolders included) -> the other folders they import."""
    folders = {m for m in graph if m.count(".") == 1 and (ROOT / m.replace(".", "/")).is_dir()}

    def folder(module: str) -> str | None:
        return next((f for f in folders if module == f or module.startswith(f + ".")), None)

    found: dict[str, set[str]] = {f: set() for f in folders}
    for module, targets in graph.items():
        if (src := folder(module)) is not None:
            found[src] |= {f for t in targets if (f := folder(t)) not in (None, src)}
    return found


def test_tasks_and_reward_do_not_loop_at_folder_level():
    """The graders live beside the tasks (tasks/graders/, the code sandbox with them): the
    reward service imports the tasks, and nothing in tasks/ imports the service's folder."""
    folders = folder_graph(import_graph(ROOT / "areal"))
    assert "areal.tasks" in folders["areal.reward"]
    assert "areal.reward" not in folders["areal.tasks"]
    assert not [c for c in cycles(folders) if {"areal.tasks", "areal.reward"} & set(c)]


def test_no_loop_between_folders():
    """Folders depend one way: a role's folder (controller, launcher, rollout, workflow)
    never reaches back to itself through another; a tokenizer, which every role loads, is
    areal/tokenizer.py, not the models' folder (rollout -> models closed two loops)."""
    folders = folder_graph(import_graph(ROOT / "areal"))
    assert len(folders) >= 10
    assert cycles(folders) == []


def test_no_import_circle_in_areal():
    graph = import_graph(ROOT / "areal")
    assert len(graph) > 100 and "areal.rollout.inference" in graph
    assert cycles(graph) == []


def test_seams_import_none_of_their_implementations():
    graph = import_graph(ROOT / "areal")
    assert not graph["areal.rollout.inference"]
    assert "areal.trainer.torch_backend" not in graph["areal.trainer.backend"]
    registry = graph["areal.rollout.backends"]
    assert not {m for m in registry if m.startswith("areal.rollout.backends.")}
    assert not registry & {"areal.rollout.client", "areal.rollout.vllm_client", "areal.config"}
    trainers = graph["areal.trainer.backends"]
    assert not {m for m in trainers if m.startswith("areal.trainer.backends.")}
    assert not trainers & {"areal.config", "areal.trainer.backend", "areal.trainer.torch_backend"}
    assert "areal.trainer.megatron" not in graph["areal.trainer.backends.torch"]


def test_the_check_finds_a_circle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\n"
    )
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.sub.b"]]
