"""The shape of the code: size limits and which parts may load which (issue 13)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hfsplit"


def test_no_function_in_the_package_runs_over_60_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} "
                            f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


@pytest.mark.parametrize("module, absent", [
    ("hfsplit.plan", ("hfsplit.costs", "hfsplit.planner", "torch._subclasses.fake_tensor")),  # the Plan is plain data
    ("hfsplit.parallel.split_model", ("hfsplit.planner",)),  # running a plan needs no planner
    ("hfsplit.training.trainer", ("hfsplit.planner",)),
    ("hfsplit.checkpoint.synthetic", ("hfsplit.training.data",)),
])
def test_runtime_modules_do_not_load_planning_code(module, absent):
    code = f"import sys, {module}; print([m for m in {list(absent)!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing {module} loads {out.strip()}"
