"""The import rules of docs/design.md and its four reading paths, read from the source by AST (imports inside
functions included).

PYTHONPATH=$PWD python -m pytest tests/test_structure.py -q
"""

import ast
import re
import subprocess
import sys

import pytest
from conftest import ROOT

PACKAGE = ROOT / "trainer"
# Loadable without the training stack: servers (ours and the vLLM plugin), exporters, eval, data jobs.
WITHOUT_LIGHTNING = (
    "trainer.drafters",
    "trainer.decoding",
    "trainer.data",
    "trainer.vlog",
    "trainer.serve",
    "trainer.export",
    "trainer.evaluate",
    "trainer.integrations",
    "trainer.snapshots",
    "trainer.runs",
)
# The daemons reach training through the training-step API (below), which loads no Lightning either.
WITHOUT_LIGHTNING_LOADED = (*WITHOUT_LIGHTNING, "trainer.adapt", "trainer.training.step")


def module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file; ``from a import b`` gives ``a`` and ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import; the package imports absolutely"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


MODULES = {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(sources: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{module} imports {imported}"
        for module, imported_names in MODULES.items()
        if any(within(module, s) for s in sources)
        for imported in imported_names
        if any(within(imported, f) for f in forbidden)
    )


def test_the_scan_sees_the_package():
    # A scan that found no modules or no imports would pass every rule below.
    assert {"trainer.drafters.dflash", "trainer.decoding.engine", "trainer.data.cache", "trainer.cli"} <= set(MODULES)
    assert "lightning" in MODULES["trainer.training.frozen_target"]
    assert "trainer.drafters.dflash" in MODULES["trainer.decoding.drafting"]


def test_the_scan_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    import lightning\n    from trainer.training import step\n")
    assert imports_of(source) == {"lightning", "trainer.training", "trainer.training.step"}


def test_the_servers_exporters_and_data_import_no_lightning():
    assert violations(WITHOUT_LIGHTNING, ("lightning", "pytorch_lightning", "trainer.training")) == []


def test_drafters_import_nothing_from_data():
    assert violations(("trainer.drafters",), ("trainer.data",)) == []


def test_nothing_imports_the_cli():
    # trainer/__main__.py is `python -m trainer`, the CLI's own entry point.
    importers = [m for m in violations(("trainer",), ("trainer.cli",)) if not m.startswith("trainer.__main__ ")]
    assert importers == []


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (node -> nodes it points to) as a path that ends where it starts, or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                walk = [*path, node]
                return [*walk[walk.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, node])):
                return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def test_no_import_cycles():
    graph = {m: {i for i in imported if i in MODULES and i != m} for m, imported in MODULES.items()}
    # Importing a submodule runs its package's __init__ first; that edge is not a cycle of the code.
    graph = {m: {i for i in edges if not within(m, i)} for m, edges in graph.items()}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


# The direction between packages (a subpackage of trainer, or a top-level module): each may import only those
# listed, so a new edge is a decision made here, and the table itself has no cycle. docs/design.md draws it.
FOUNDATION = ("trainer.errors", "trainer.io", "trainer.paths")
ALLOWED: dict[str, tuple[str, ...]] = {
    "trainer.errors": (),
    "trainer.io": (),
    "trainer.paths": (),
    "trainer.sampling": (),
    "trainer.textstats": (),
    "trainer.devices": ("trainer.errors",),
    "trainer.runs": ("trainer.errors", "trainer.paths"),
    "trainer.recipes": ("trainer.errors", "trainer.paths"),
    "trainer.target": ("trainer.errors", "trainer.paths"),
    "trainer.snapshots": ("trainer.errors", "trainer.io"),
    "trainer.strategies": ("trainer.io",),
    "trainer.checkpoint_io": ("trainer.io",),
    "trainer.callbacks": ("trainer.errors",),
    "trainer.optim": (),
    "trainer.drafters": FOUNDATION,
    "trainer.losses": ("trainer.drafters",),
    "trainer.tiny": (*FOUNDATION, "trainer.optim", "trainer.textstats"),
    "trainer.data": (*FOUNDATION, "trainer.devices", "trainer.drafters", "trainer.recipes",
                     "trainer.sampling", "trainer.target", "trainer.tiny"),
    "trainer.decoding": ("trainer.errors", "trainer.drafters", "trainer.sampling", "trainer.target"),
    "trainer.vlog": ("trainer.errors", "trainer.io", "trainer.decoding", "trainer.sampling"),
    "trainer.training": (*FOUNDATION, "trainer.data", "trainer.drafters", "trainer.losses",
                         "trainer.optim", "trainer.target"),
    "trainer.export": (*FOUNDATION, "trainer.devices", "trainer.drafters", "trainer.runs"),
    "trainer.evaluate": (*FOUNDATION, "trainer.decoding", "trainer.devices", "trainer.drafters", "trainer.runs",
                         "trainer.snapshots", "trainer.target", "trainer.textstats", "trainer.vlog"),
    "trainer.serve": (*FOUNDATION, "trainer.data", "trainer.decoding", "trainer.devices", "trainer.drafters",
                      "trainer.runs", "trainer.snapshots", "trainer.target", "trainer.vlog"),
    "trainer.adapt": (*FOUNDATION, "trainer.data", "trainer.devices", "trainer.drafters", "trainer.runs",
                      "trainer.snapshots", "trainer.target", "trainer.training", "trainer.vlog"),
    "trainer.integrations": (*FOUNDATION, "trainer.decoding", "trainer.drafters", "trainer.evaluate",
                             "trainer.export", "trainer.sampling", "trainer.snapshots", "trainer.vlog"),
    "trainer.cli": ("trainer.adapt", "trainer.data", "trainer.errors", "trainer.evaluate",
                    "trainer.export", "trainer.recipes", "trainer.serve", "trainer.training"),
    "trainer.__main__": ("trainer.cli",),
    "trainer": (),
}  # fmt: skip


def package_of(module: str) -> str:
    """``trainer.decoding.engine`` -> ``trainer.decoding``; a top-level module is its own package."""
    parts = module.split(".")
    return ".".join(parts[:2])


def package_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import (project imports only)."""
    graph: dict[str, set[str]] = {}
    for module, imported in modules.items():
        edges = graph.setdefault(package_of(module), set())
        edges.update(package_of(i) for i in imported if within(i, "trainer") and i != "trainer")
    return {p: edges - {p} for p, edges in graph.items()}


def disallowed(graph: dict[str, set[str]], allowed: dict[str, tuple[str, ...]]) -> list[str]:
    unknown = [f"{p} is in no row of ALLOWED" for p in graph if p not in allowed]
    placed = {p: edges for p, edges in graph.items() if p in allowed}
    return unknown + sorted(f"{p} imports {q}" for p, edges in placed.items() for q in edges - set(allowed[p]))


def test_packages_import_only_in_the_allowed_direction():
    assert disallowed(package_graph(MODULES), ALLOWED) == []


def test_the_allowed_direction_has_no_cycle():
    cycle = find_cycle({p: set(edges) for p, edges in ALLOWED.items()})
    assert cycle is None, " -> ".join(cycle)


def test_the_package_check_catches_a_violation():
    """The checker on a made-up graph: an edge against the table, an unplaced package, and a package cycle."""
    modules = {"trainer.decoding.engine": {"trainer.vlog.schema"}, "trainer.vlog.recorder": {"trainer.decoding.engine"},
               "trainer.newpkg.x": {"trainer.errors"}}  # fmt: skip
    graph = package_graph(modules)
    assert graph == {"trainer.decoding": {"trainer.vlog"}, "trainer.vlog": {"trainer.decoding"},
                     "trainer.newpkg": {"trainer.errors"}}  # fmt: skip
    expected = ["trainer.newpkg is in no row of ALLOWED", "trainer.decoding imports trainer.vlog"]
    assert disallowed(graph, ALLOWED) == expected
    assert find_cycle(graph) == ["trainer.decoding", "trainer.vlog", "trainer.decoding"]


def test_the_daemons_reach_training_only_through_the_training_step_api():
    reached = [v.split(" imports ")[1] for v in violations(("trainer.adapt",), ("trainer.training",))]
    assert reached and all(within(name, "trainer.training.step") for name in reached), reached


@pytest.mark.slow
def test_lightning_stays_out_transitively():
    """What the modules import in turn (transformers, torch, ...) must not bring Lightning in either."""
    # The vLLM plugin needs vLLM's environment (its tests import it there); the static rule above covers it here.
    names = sorted(m for m in MODULES if any(within(m, p) for p in WITHOUT_LIGHTNING_LOADED)
                   and not within(m, "trainer.integrations"))  # fmt: skip
    code = f"import importlib, sys\nfor n in {names!r}:\n    importlib.import_module(n)\n"
    code += "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning'))\n"
    code += "assert not loaded, loaded[:5]\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_log_recorder_loads_no_drafter_architecture():
    """Servers and the vLLM plugin import the recorder; it needs one leaf of ``trainer.drafters`` (the attention
    masks of verification), not the drafter models that the package's public names bring in."""
    code = "import sys, trainer.vlog.recorder\n"
    code += "print(sorted(m for m in sys.modules if m.startswith('trainer.drafters.')))\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[-2] == "['trainer.drafters.attention']"


# ---- docs/design.md, "Four paths through the code" ------------------------------------------------------------
STEP = re.compile(r"(\d+)\. `(trainer/[\w/]+\.py)` `([\w.]+)`(.*)")
HEADING = re.compile(r"\*\*(.+)\*\* \((\d+) files, (\d+) with side trips\)")


def reading_paths(text: str) -> dict[str, tuple[tuple[int, int], list[tuple[str, str, str]]]]:
    """Path title -> ((files, files with side trips) as its heading states, [(file, qualname, step text)])."""
    section = text.split("## Four paths through the code", 1)[1].split("\n## ", 1)[0]
    paths: dict = {}
    steps: list = []
    for line in section.splitlines():
        if heading := HEADING.fullmatch(line):
            steps = []
            paths[heading[1]] = ((int(heading[2]), int(heading[3])), steps)
        elif step := STEP.fullmatch(line):
            assert int(step[1]) == len(steps) + 1, f"{line}: steps are numbered in order"
            steps.append((step[2], step[3], step[4]))
        elif line.startswith("   ") and steps:
            file, name, text = steps[-1]
            steps[-1] = (file, name, f"{text} {line.strip()}")
    return paths


def definition(file: str, qualname: str) -> ast.AST:
    """The class or function ``qualname`` (``Class.method`` or a top-level name) of ``file``."""
    body = ast.parse((ROOT / file).read_text()).body
    for part in qualname.split("."):
        found = [n for n in body if isinstance(n, ast.ClassDef | ast.FunctionDef) and n.name == part]
        assert found, f"{file} defines no {qualname}"
        body = found[0].body
    return found[0]


def calls(node: ast.AST, name: str) -> bool:
    """Whether ``node``'s source reaches ``name``: by name or attribute, ``__iter__`` through ``iter``, and
    ``__call__`` as a call on the result of a call (``make(...)(x)``)."""
    nodes = list(ast.walk(node))
    if name == "__call__":
        return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Call) for n in nodes)
    if name == "__iter__":
        name = "iter"
    return name in {n.id for n in nodes if isinstance(n, ast.Name)} | {
        n.attr for n in nodes if isinstance(n, ast.Attribute)
    }


def test_the_reading_paths_name_real_functions_and_real_calls():
    paths = reading_paths((ROOT / "docs" / "design.md").read_text())
    assert len(paths) == 4
    for title, ((files, with_side_trips), steps) in paths.items():
        step_files = {file for file, _, _ in steps}
        side_trips = {f for _, _, text in steps for f in re.findall(r"`(trainer/[\w/]+\.py)`", text)}
        assert (len(step_files), len(step_files | side_trips)) == (files, with_side_trips), title
        assert all((ROOT / f).is_file() for f in side_trips), title
        for i, (file, name, text) in enumerate(steps):
            node = definition(file, name)
            if i + 1 < len(steps) and not text.endswith("⇢"):
                after = steps[i + 1][1]
                assert calls(node, after.split(".")[-1]), f"{title}: {file} {name} does not call {after}"
