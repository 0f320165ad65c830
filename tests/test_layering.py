"""Data flows one way (README "Layout of the code"): lower layers never import higher ones, so a
parallelism added in `parallel` or a feature in `models` cannot quietly depend on the loop."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "megalite"

# package -> the megalite packages and modules it must never import (directly or lazily inside a function)
FORBIDDEN = {
    "ops": {"parallel", "models", "pipeline", "optim", "training", "checkpoint", "tools", "config"},
    # FP8's numbers (formats, recipes, quantization, the scaled GEMM): plain tensor math, below parallel.
    "precision": {"parallel", "models", "pipeline", "optim", "training", "checkpoint", "tools", "config", "data",
                  "runtime", "ops"},
    "parallel": {"models", "pipeline", "optim", "training", "checkpoint", "tools", "data", "config", "runtime"},
    "models": {"training", "pipeline", "optim", "checkpoint", "tools", "data", "arguments", "config", "runtime"},
    "pipeline": {"training", "optim", "checkpoint", "tools", "data", "config"},
    "optim": {"models", "training", "pipeline", "checkpoint", "tools", "data", "config"},
    # The typed configuration sits beside models (it builds their config): nothing of the run below it.
    "config": {"training", "tools", "checkpoint", "optim", "data"},
    "data": {"parallel", "models", "pipeline", "optim", "training", "checkpoint", "tools"},
    "checkpoint": {"training", "tools", "pipeline"},
}


def megalite_imports(path: Path) -> set[str]:
    """The top-level megalite packages/modules a file imports (`from megalite import x` counts x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "megalite":
                continue
            found.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "megalite" and len(parts) > 1:
                    found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layers_never_import_higher_ones(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"megalite/{package} has no modules"
    bad = {str(f.relative_to(ROOT.parent)): sorted(megalite_imports(f) & FORBIDDEN[package]) for f in files}
    assert not {f: names for f, names in bad.items() if names}, f"megalite.{package} imports a higher layer"


def test_the_import_scan_sees_lazy_and_dotted_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import megalite.models.gpt\ndef g():\n    from megalite import training, ops\n"
                 "    from megalite.optim.grads import x\n")
    assert megalite_imports(f) == {"models", "training", "ops", "optim"}


# ---- no import circle, inside a package or across ------------------------------------------------------------------

def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """megalite module -> the megalite modules it imports (at the top, in functions, or for type
    checking: an import anywhere is a dependency). `from megalite.a import b` is an edge to the module
    megalite.a.b where there is one, else to megalite.a."""
    files = {module_name(f, root): f for f in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if not base.startswith(root.name):
                    continue
                for alias in node.names:
                    edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name.startswith(root.name + "."))
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (its modules in order, the first repeated at the end), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_module_imports_itself_back():
    cycle = find_cycle(module_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_a_planted_circle_and_a_planted_wrong_way_import_are_caught(tmp_path):
    pkg = tmp_path / "megalite"
    for sub in ("parallel", "training"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "parallel" / "a.py").write_text("from megalite.parallel import b\n")
    (pkg / "parallel" / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "training" / "loop.py").write_text("import megalite.parallel.a\n")
    assert find_cycle(module_graph(pkg)) == ["megalite.parallel.a", "megalite.parallel.b", "megalite.parallel.a"]
    (pkg / "parallel" / "b.py").write_text("from megalite.training import loop\n")  # parallel -> training
    assert megalite_imports(pkg / "parallel" / "b.py") & FORBIDDEN["parallel"] == {"training"}
    assert find_cycle(module_graph(pkg)) == ["megalite.parallel.a", "megalite.parallel.b", "megalite.training.loop",
                                             "megalite.parallel.a"]
