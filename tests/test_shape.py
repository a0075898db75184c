"""The shape of the code: size limits, the package's import rules, and which parts may load which (issues 13, 19).

The import rules are read from the code itself (every `import` statement of hfsplit's own modules, those inside
functions included):
- no cycle among hfsplit's modules;
- no module imports another module's private (`_name`) names;
- imports point down the layers: the contract (errors, plan, schedules, budget), then models, checkpoint, then
  planning and apply (which never import each other), parallel, load, training (its data and its loop, which
  calls the objective it is given), the objectives, the run built from an objective's name with its options, and
  cli;
- hfsplit's own imports sit at the top of files, but for the few `LAZY` ones, each kept for a reason its
  comment gives.
"""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hfsplit"

# Each part's rank: a module imports only modules of its own part or of a lower rank.
LAYERS = {
    "hfsplit": 0, "hfsplit.errors": 0, "hfsplit.plan": 0, "hfsplit.schedules": 0, "hfsplit.budget": 0,
    "hfsplit.configs": 0, "hfsplit.gpu_kinds": 0,
    "hfsplit.models": 1,
    "hfsplit.checkpoint": 2,
    "hfsplit.planning": 3, "hfsplit.apply": 3, "hfsplit.ship": 3,
    "hfsplit.parallel": 4,
    "hfsplit.load": 5,
    "hfsplit.training": 6,
    "hfsplit.objectives": 7,  # between training's data and loop below and the run that names an objective above
    "hfsplit.training.options": 8, "hfsplit.training.run": 8,
    "hfsplit.cli": 9, "hfsplit.finetune": 9,
}
# Parts of one rank that must not import each other: deciding a split and applying one are independent.
APART = {("hfsplit.planning", "hfsplit.apply"), ("hfsplit.apply", "hfsplit.planning")}
# hfsplit imports kept inside a function: (file, imported module) → why.
LAZY = {
    ("training/memory.py", "hfsplit.planning.planner"):
        "the training loop loads the planner only to explain an out-of-memory step with a re-plan",
    ("cli/commands.py", "hfsplit.cli.plan"): "`hfsplit --help` loads no torch (under 1 s)",
    ("cli/plan.py", "hfsplit.planning.planner"): "`hfsplit plan --help` loads no transformers nor cost model",
    ("cli/plan.py", "hfsplit.checkpoint.synthetic"): "the same (the checkpoint package imports torch)",
    ("cli/plan.py", "hfsplit.planning.max_seq"): "the same (it loads configs through the checkpoint package)",
    ("cli/plan.py", "hfsplit.load.proof"): "the proof builds models: `hfsplit --help` loads none of it",
    ("cli/plan.py", "hfsplit.load.tp_proof"): "the same (the tp proof imports the proof)",
    ("finetune.py", "hfsplit.training.run"): "the recipe parses its flags before the training stack loads",
    ("finetune.py", "hfsplit.cli.charts"): "matplotlib loads only where a run recorded a timeline to draw",
    ("training/interrupts.py", "hfsplit.training.resume"): "the recipe's --help loads no torch (resume.py does)",
    # `hfsplit plan --help` and the parsing of its flags load no torch nor transformers (issue 33): what runs loads them
    ("cli/plan.py", "hfsplit.checkpoint.resolve"): "the checkpoint package loads torch",
    ("cli/plan.py", "hfsplit.planning.memory_choices"): "it reads models' layouts (torch)",
    ("cli/ship.py", "hfsplit.ship.merge"): "the merge streams tensors (torch)",
    ("cli/ship.py", "hfsplit.ship.gguf_export"): "the export reads tensors (torch)",
    ("objectives/registry.py", "hfsplit.objectives.sft"): "an objective trains (torch); its options are read without",
    ("objectives/registry.py", "hfsplit.objectives.dpo"): "the same",
    ("objectives/registry.py", "hfsplit.objectives.grpo"): "the same (it generates through transformers)",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports():
    """(file, line, importing module, imported module, names, inside a function, line text) for every import of
    an hfsplit module by an hfsplit module."""
    out = []
    for name, path in MODULES.items():
        source = path.read_text()
        tree = ast.parse(source)
        inside = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(fn)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                targets = [(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            else:
                continue
            line = source.splitlines()[node.lineno - 1]
            for target, imported in targets:
                while target and target not in MODULES:
                    target = target.rpartition(".")[0]
                if target.startswith("hfsplit") and target != name:
                    out.append((path.relative_to(PACKAGE).as_posix(), node.lineno, name, target, imported,
                                id(node) in inside, line))
    return out


def _part(module: str) -> str:
    return next(p for p in sorted(LAYERS, key=len, reverse=True) if module == p or module.startswith(p + "."))


def test_no_function_in_the_package_runs_over_60_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} "
                            f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


def test_the_top_level_holds_only_the_contract_and_the_entry_point():
    """At most six flat modules beside the packages: the rest of the code lives in the room of its part."""
    flat = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(flat) <= 6, flat


def test_no_import_cycle_among_the_package_modules():
    """Counting imports inside functions: a cycle they hide still ties the modules together. A package's
    `__init__` re-exporting its modules is no cycle (importing a sibling by name does not run it twice)."""
    edges = {}
    for _, _, importer, imported, _, _, _ in _imports():
        if MODULES[imported].name != "__init__.py":
            edges.setdefault(importer, set()).add(imported)
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_no_module_imports_another_modules_private_names():
    private = [f"{file}:{line} {name}" for file, line, _, _, name, _, _ in _imports()
               if name and name.startswith("_") and not name.startswith("__")]
    assert not private, private


def test_imports_point_down_the_layers():
    """planning never imports apply, parallel, load or training; parallel never imports planning, load or
    training; apply never imports planning, parallel, load or training; and so on down the table."""
    upward = []
    for file, line, importer, imported, _, _, _ in _imports():
        mine, theirs = _part(importer), _part(imported)
        if mine != theirs and (LAYERS[theirs] > LAYERS[mine] or (mine, theirs) in APART):
            upward.append(f"{file}:{line} {importer} imports {imported}")
    assert not upward, upward


def test_the_package_imports_its_own_modules_at_the_top_of_files():
    inside = [(file, imported) for file, _, _, imported, _, lazy, _ in _imports() if lazy]
    assert all(key in LAZY for key in inside), sorted(set(inside) - set(LAZY))
    assert set(LAZY) <= set(inside), f"LAZY names imports that are gone: {sorted(set(LAZY) - set(inside))}"
    uncommented = [f"{file}:{line}" for file, line, _, imported, _, lazy, text in _imports() if lazy and "#" not in text]
    assert not uncommented, f"a lazy import says why in a comment on its line: {uncommented}"


@pytest.mark.parametrize("module, absent", [
    # the Plan is plain data
    ("hfsplit.plan", ("hfsplit.planning.costs.model", "hfsplit.planning.planner", "torch._subclasses.fake_tensor")),
    ("hfsplit.parallel.split_model", ("hfsplit.planning.planner",)),  # running a plan needs no planner
    ("hfsplit.training.trainer", ("hfsplit.planning.planner",)),  # the loop needs none either (training/run.py plans)
    ("hfsplit.checkpoint.synthetic", ("hfsplit.training.data",)),
    ("hfsplit.apply.steps", ("hfsplit.planning.planner", "hfsplit.planning.costs.model")),  # applying plans nothing
])
def test_runtime_modules_do_not_load_planning_code(module, absent):
    code = f"import sys, {module}; print([m for m in {list(absent)!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing {module} loads {out.strip()}"


LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")


def test_only_the_mesh_reads_the_launchers_environment():
    """One way in: `hfsplit.parallel.mesh` (`launcher_world`, `init_distributed`) reads what the launcher sets;
    every other module takes a `World` (the elastic regroup returns a new one, it writes no environment)."""
    readers = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in LAUNCHER_ENV:
                readers.add(name)
    assert readers <= {"hfsplit.parallel.mesh"}, sorted(readers)
