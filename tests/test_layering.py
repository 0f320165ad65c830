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
