"""The import rules of docs/design.md, read from the source by AST (imports inside functions included).

PYTHONPATH=$PWD python -m pytest tests/test_structure.py -q
"""

import ast
import subprocess
import sys

from conftest import ROOT

PACKAGE = ROOT / "trainer"
# Loadable without the training stack: a server, an exporter or a data job imports these.
WITHOUT_LIGHTNING = ("trainer.drafters", "trainer.decoding", "trainer.data", "trainer.vlog")


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


def test_drafters_spec_and_data_import_no_lightning():
    assert violations(WITHOUT_LIGHTNING, ("lightning", "pytorch_lightning", "trainer.training")) == []


def test_drafters_import_nothing_from_data():
    assert violations(("trainer.drafters",), ("trainer.data",)) == []


def test_nothing_imports_the_cli():
    # trainer/__main__.py is `python -m trainer`, the CLI's own entry point.
    importers = [m for m in violations(("trainer",), ("trainer.cli",)) if not m.startswith("trainer.__main__ ")]
    assert importers == []


def test_no_import_cycles():
    graph = {m: {i for i in imported if i in MODULES and i != m} for m, imported in MODULES.items()}
    # Importing a submodule runs its package's __init__ first; that edge is not a cycle of the code.
    graph = {m: {i for i in edges if not within(m, i)} for m, edges in graph.items()}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for nxt in sorted(graph[module]):
            if state.get(nxt) == "open":
                walk = [*path, module]
                return [*walk[walk.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, module])):
                return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [])
            assert cycle is None, " -> ".join(cycle)


def test_lightning_stays_out_transitively():
    """What the modules import in turn (transformers, torch, ...) must not bring Lightning in either."""
    names = sorted(m for m in MODULES if any(within(m, p) for p in WITHOUT_LIGHTNING))
    code = f"import importlib, sys\nfor n in {names!r}:\n    importlib.import_module(n)\n"
    code += "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning'))\n"
    code += "assert not loaded, loaded[:5]\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
