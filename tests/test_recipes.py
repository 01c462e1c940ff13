"""Every shipped recipe resolves: keys and types checked, nothing loaded (``--print_config``)."""

import pytest
import yaml
from conftest import ROOT

from trainer.cli import main

RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))


def test_recipes_are_shipped():
    assert {
        "target_tiny",
        "dflash_tiny",
        "treeflash_tiny",
        "dflash_qwen3_4b",
        "treeflash_qwen3_4b",
        "treeflash_qwen3_8b",
    } <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_parses_and_opens_with_its_command(name, capsys):
    text = (ROOT / "recipes" / f"{name}.yaml").read_text()
    assert text.startswith(f"# trainer fit --recipe {name}")
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--recipe", name, "--print_config"])
    assert exc.value.code == 0, capsys.readouterr().err
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"].startswith("trainer.")
