"""Packaging: every third-party module the package imports is a declared dependency of pyproject.toml."""

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_dependencies() -> set[str]:
    """The required dependencies plus the optional extras a user opts into (deepspeed: imported only when a
    ZeRO strategy runs); the dev extra (test tools) never counts for the package's imports."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [spec for name, specs in project["optional-dependencies"].items() if name != "dev" for spec in specs]
    return {normalise(re.split(r"[\s\[<>=!~;]", spec, maxsplit=1)[0]) for spec in project["dependencies"] + extras}


def imported_top_level_modules() -> dict[str, Path]:
    """Third-party top-level modules imported anywhere in ``trainer/`` (lazy imports inside functions too)."""
    found: dict[str, Path] = {}
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top != "trainer":
                    found.setdefault(top, path)
    return found



def test_every_imported_module_is_a_declared_dependency():
    declared = declared_dependencies()
    providers = importlib.metadata.packages_distributions()
    undeclared = []
    for module, path in imported_top_level_modules().items():
        distributions = {normalise(d) for d in providers.get(module, [module])}
        if not distributions & declared:
            undeclared.append(f"{module} ({path.relative_to(ROOT)}; distribution {sorted(distributions)})")
    assert not undeclared, f"imported but not in [project] dependencies: {undeclared}"


def test_shipped_assets_resolve_from_any_directory(tmp_path, monkeypatch):
    """Recipes by bare name and the shipped checkpoints and prompts by their repository paths, from a working
    directory that holds none of them."""
    from trainer.paths import SHIPPED_ROOT, project_path
    from trainer.recipes import resolve_recipe

    monkeypatch.chdir(tmp_path)
    assert project_path("checkpoints/target_tiny") == SHIPPED_ROOT / "checkpoints" / "target_tiny"
    assert (project_path("checkpoints/dflash_tiny") / "model.safetensors").is_file()
    assert project_path("data/prompts/stdlib_heldout.jsonl").is_file()
    assert resolve_recipe("treeflash_tiny") == SHIPPED_ROOT / "recipes" / "treeflash_tiny.yaml"
    # A path that names nothing shipped comes back as written, for the loader to report.
    assert project_path("checkpoints/nope") == Path("checkpoints/nope")
    # A file in the working directory wins over the shipped one of the same relative path.
    (tmp_path / "checkpoints" / "target_tiny").mkdir(parents=True)
    assert project_path("checkpoints/target_tiny") == Path("checkpoints/target_tiny")
