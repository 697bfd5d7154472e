"""The house's rules, read off the code: layers import only downwards, no module imports itself
back through others, no module or function outgrows what one reader holds, and the paths research
code imports still work.

The layers (lowest last) are declared once, in pyproject.toml's [tool.importlinter]; import-linter
reads every import statement, those inside functions included.
"""

import ast
import pathlib
import shutil
import subprocess
import sys

import grimp
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "grpo_jax"


def _lint_imports(cwd: pathlib.Path) -> subprocess.CompletedProcess:
    # A fresh process: grimp must read the package under `cwd`, not the one this process imported.
    code = "from importlinter.cli import lint_imports; raise SystemExit(lint_imports(no_cache=True))"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_the_layer_contract_holds():
    result = _lint_imports(REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 kept, 0 broken" in result.stdout


def test_a_planted_upward_import_breaks_the_contract(tmp_path):
    # The pure math importing the trainer: the one thing the layering exists to stop.
    shutil.copytree(PACKAGE, tmp_path / "grpo_jax", ignore=shutil.ignore_patterns("__pycache__", "assets"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "grpo_jax" / "core" / "evaluation.py"
    target.write_text(target.read_text() + "\n\ndef _planted():\n    from grpo_jax.training import train  # noqa\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "grpo_jax.core is not allowed to import grpo_jax.training" in result.stdout, result.stdout[-3000:]
    assert "grpo_jax.core.evaluation -> grpo_jax.training.train" in result.stdout


def _module_cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan). An import of one's own
    parent package (`from grpo_jax.model import blockwise` inside grpo_jax.model.attention) is not
    an edge: the package's __init__ running first is how Python imports, not a cycle between jobs."""
    edges = {m: {d for d in graph.find_modules_directly_imported_by(m)
                 if not (m.startswith(d + ".") or d.startswith(m + "."))} for m in graph.modules}
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_no_module_imports_itself_back():
    assert _module_cycles(grimp.build_graph("grpo_jax")) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = grimp.build_graph("grpo_jax")
    graph.add_import(importer="grpo_jax.core.losses", imported="grpo_jax.core.objectives")
    graph.add_import(importer="grpo_jax.core.objectives", imported="grpo_jax.core.losses")
    assert ["grpo_jax.core.losses", "grpo_jax.core.objectives"] in _module_cycles(graph)


MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80  # docstring and comments included: what a reader scrolls through


def _sizes(path: pathlib.Path):
    source = path.read_text()
    yield "module", path.name, source.count("\n")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield "function", f"{node.name} (line {node.lineno})", node.end_lineno - node.lineno + 1


def test_no_module_over_500_lines_and_no_function_over_80():
    too_big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for kind, name, lines in _sizes(path):
            limit = MAX_MODULE_LINES if kind == "module" else MAX_FUNCTION_LINES
            if lines > limit:
                too_big.append(f"{path.relative_to(REPO)}: {kind} {name}: {lines} lines > {limit}")
    assert too_big == []


@pytest.mark.parametrize("old, new", [
    ("losses", "core.losses"), ("advantages", "core.advantages"), ("objectives", "core.objectives"),
    ("advantage_estimators", "core.advantage_estimators"), ("evaluation", "core.evaluation"), ("hf", "io.hf"),
])
def test_the_research_import_paths_are_the_moved_modules(old, new):
    import importlib

    assert importlib.import_module(f"grpo_jax.{old}") is importlib.import_module(f"grpo_jax.{new}")


def test_the_research_names_import_from_the_old_paths():
    from grpo_jax.advantages import group_advantages
    from grpo_jax.evaluation import pass_at_k
    from grpo_jax.losses import grpo_loss
    from grpo_jax.objectives import policy_loss

    assert all(callable(f) for f in (group_advantages, pass_at_k, grpo_loss, policy_loss))
