import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import ROOT

import trainer.data.cli as data_cli
from trainer.cli import StepProgressBar, TrainerCLI, main
from trainer.recipes import RecipeError, available_recipes, parse_overrides, resolve_recipe


def run_main(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    captured = capsys.readouterr()
    return exc.value.code, captured.out + captured.err


def write_recipe(tmp_path: Path, edit) -> Path:
    recipe = yaml.safe_load((ROOT / "recipes" / "target_tiny.yaml").read_text())
    edit(recipe)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_resolve_bare_name_with_and_without_suffix(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the package's recipes/ is found from anywhere
    assert resolve_recipe("target_tiny").resolve() == ROOT / "recipes" / "target_tiny.yaml"
    assert resolve_recipe("target_tiny.yaml").resolve() == ROOT / "recipes" / "target_tiny.yaml"
    assert "target_tiny" in available_recipes()


def test_resolve_path_and_local_recipes_dir(monkeypatch, tmp_path):
    own = tmp_path / "mine.yaml"
    own.write_text("trainer: {max_steps: 1}\n")
    assert resolve_recipe(str(own)) == own
    assert resolve_recipe(str(tmp_path / "mine")) == own
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "local_one.yaml").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_recipe("local_one").name == "local_one.yaml"


def test_unknown_recipe_suggests_closest():
    with pytest.raises(RecipeError, match=r"recipe 'target_tinny' not found. Did you mean 'target_tiny'\?"):
        resolve_recipe("target_tinny")


def test_override_parsing():
    got = parse_overrides(["--a.b", "1", "--c=2", "--flag", "--d", "x y"])
    assert [(o.key, o.value) for o in got] == [("a.b", "1"), ("c", "2"), ("flag", None), ("d", "x y")]
    with pytest.raises(RecipeError, match="unexpected argument 'stray'"):
        parse_overrides(["stray"])


@pytest.mark.slow
def test_misspelt_model_key_in_override_names_recipe_key_and_suggestion():
    # The acceptance command, as a user runs it: one screen, no traceback, exit code 2.
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "fit", "--recipe", "target_tiny", "--model.hiden_size", "3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "hiden_size" in out and "did you mean: model.hidden_size" in out
    assert "recipes/target_tiny.yaml" in out
    assert "Traceback" not in out
    assert len(out.splitlines()) < 25


def test_misspelt_key_in_recipe_file(capsys, tmp_path):
    def misspell(recipe):
        args = recipe["model"]["init_args"]
        args["hiden_size"] = args.pop("hidden_size")

    path = write_recipe(tmp_path, misspell)
    code, out = run_main(capsys, "fit", "--recipe", str(path))
    assert code == 2
    assert "unknown key 'model.init_args.hiden_size' in the recipe file" in out
    assert str(path) in out and "did you mean: model.init_args.hidden_size" in out


def test_misspelt_trainer_key_in_file_and_override(capsys, tmp_path):
    path = write_recipe(tmp_path, lambda r: r["trainer"].update(max_stepz=3))
    code, out = run_main(capsys, "fit", "--recipe", str(path))
    assert code == 2 and "trainer.max_stepz" in out and "did you mean: trainer.max_steps" in out
    code, out = run_main(capsys, "fit", "--recipe", "target_tiny", "--trainer.max_stepz", "3")
    assert code == 2 and "in the override --trainer.max_stepz" in out and "trainer.max_steps" in out


def test_drafter_keys_declared_by_the_base_class_are_checked_and_passed_on(capsys):
    # min_lr_ratio is declared by FrozenTargetTraining and reaches DFlashTraining through **kwargs.
    code, out = run_main(capsys, "fit", "--recipe", "dflash_tiny", "--model.min_lr_ratoi", "0.2")
    assert code == 2 and "did you mean: model.min_lr_ratio" in out
    code, out = run_main(capsys, "fit", "--recipe", "dflash_tiny", "--model.min_lr_ratio", "0.2", "--print_config")
    assert code == 0
    init_args = yaml.safe_load(out)["model"]["init_args"]
    # Base arguments, block-drafter arguments and the recipe's values all resolve.
    assert (init_args["min_lr_ratio"], init_args["gamma"], init_args["seed"]) == (0.2, 7.0, 0)
    assert init_args["lr"] == 0.002 and init_args["weight_decay"] == 0.01
    # A family's own default of a shared argument wins over the base's (EAGLE-3: no weight decay).
    code, out = run_main(capsys, "fit", "--recipe", "eagle3_tiny", "--print_config")
    assert code == 0 and yaml.safe_load(out)["model"]["init_args"]["weight_decay"] == 0.0


def test_unknown_top_level_key_lists_valid_keys(capsys, tmp_path):
    path = write_recipe(tmp_path, lambda r: r.update(seed_everythin=1))
    code, out = run_main(capsys, "fit", "--recipe", str(path))
    assert code == 2 and "unknown key 'seed_everythin'" in out and "seed_everything" in out


def test_wrong_type_names_key_and_expectation(capsys):
    code, out = run_main(capsys, "fit", "--recipe", "target_tiny", "--model.hidden_size", "abc")
    assert code == 2
    assert "invalid value for 'model.hidden_size'" in out and "int" in out and "abc" in out
    code, out = run_main(capsys, "fit", "--recipe", "target_tiny", "--data.batch_size", "many")
    assert code == 2 and "data.batch_size" in out
    code, out = run_main(capsys, "fit", "--recipe", "target_tiny", "--model.export_dtype", "float8")
    assert code == 2 and "model.export_dtype" in out


def test_unimportable_class_path(capsys, tmp_path):
    path = write_recipe(tmp_path, lambda r: r["model"].update(class_path="trainer.nowhere.Model"))
    code, out = run_main(capsys, "fit", "--recipe", str(path))
    assert code == 2 and "trainer.nowhere.Model" in out and "cannot be imported" in out


def test_broken_yaml_and_non_mapping(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: [1,\n")
    code, out = run_main(capsys, "fit", "--recipe", str(bad))
    assert code == 2 and "is not valid YAML" in out and "line" in out
    bad.write_text("- a\n- b\n")
    code, out = run_main(capsys, "fit", "--recipe", str(bad))
    assert code == 2 and "must be a mapping" in out


def test_unknown_command_and_missing_recipe(capsys):
    code, out = run_main(capsys, "fitt", "--recipe", "target_tiny")
    assert code == 2 and "Did you mean 'fit'" in out
    code, out = run_main(capsys, "fit")
    assert code == 2 and "needs --recipe" in out
    code, out = run_main(capsys, "fit", "--recipe")
    assert code == 2 and "--recipe needs" in out


def test_missing_tokenizer_is_reported_before_training(capsys, tmp_path):
    code, out = run_main(capsys, "fit", "--recipe", "target_tiny", "--data.tokenizer", str(tmp_path / "none"))
    assert code == 2 and "no tokenizer at" in out and "python -m trainer.tiny.tokenizer" in out


def test_print_config_resolves_recipe(capsys):
    code, out = run_main(capsys, "fit", "--recipe", "target_tiny", "--trainer.max_steps", "7", "--print_config")
    assert code == 0
    printed = yaml.safe_load(out)
    assert printed["trainer"]["max_steps"] == 7
    assert printed["model"]["class_path"] == "trainer.tiny.pretrain.TargetPretraining"
    assert printed["model"]["init_args"]["num_hidden_layers"] == 8


def test_help_lists_commands_and_recipes(capsys):
    main([])
    out = capsys.readouterr().out
    assert "fit" in out and "validate" in out and "target_tiny" in out


def test_misspelt_key_inside_a_typed_group(capsys, tmp_path):
    code, out = run_main(capsys, "fit", "--recipe", "dflash_tiny", "--data.spec.max_lenght", "5")
    assert code == 2 and "unknown key 'data.spec.max_lenght'" in out and "did you mean: data.spec.max_length" in out
    recipe = yaml.safe_load((ROOT / "recipes" / "dflash_tiny.yaml").read_text())
    recipe["data"]["init_args"]["spec"]["pathz"] = recipe["data"]["init_args"]["spec"].pop("paths")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, out = run_main(capsys, "fit", "--recipe", str(path))
    assert code == 2 and "data.init_args.spec.pathz" in out and "did you mean: data.init_args.spec.paths" in out


def test_validate_needs_a_checkpoint(capsys):
    code, out = run_main(capsys, "validate", "--recipe", "target_tiny")
    assert code == 2 and "--ckpt_path" in out


def test_data_tokenizer_defaults_to_the_targets(capsys, tmp_path):
    """A drafter recipe that leaves data.spec.tokenizer out tokenizes with its target's tokenizer (the tiny
    recipes rely on it); a copy of the target's tokenizer is the same tokenizer; another one is an error
    naming both, before anything loads."""
    from transformers import AutoTokenizer

    code, out = run_main(capsys, "fit", "--recipe", "treeflash_tiny", "--print_config")
    assert code == 0
    assert yaml.safe_load(out)["data"]["init_args"]["spec"]["tokenizer"] == "checkpoints/target_tiny"
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "checkpoints" / "target_tiny")
    tokenizer.save_pretrained(tmp_path / "same")
    code, out = run_main(capsys, "fit", "--recipe", "treeflash_tiny", "--data.spec.tokenizer", str(tmp_path / "same"),
                         "--print_config")  # fmt: skip
    assert code == 0 and yaml.safe_load(out)["data"]["init_args"]["spec"]["tokenizer"] == str(tmp_path / "same")
    tokenizer.add_tokens(["<|not_in_the_target|>"])
    tokenizer.save_pretrained(tmp_path / "other")
    code, out = run_main(capsys, "fit", "--recipe", "treeflash_tiny", "--data.spec.tokenizer", str(tmp_path / "other"))
    assert code == 2
    assert f"'{tmp_path / 'other'}'" in out and "'checkpoints/target_tiny'" in out and "vocabulary" in out


@pytest.mark.parametrize(
    ("given", "paths"),
    [
        (["a.jsonl"], ["a.jsonl"]),
        (["a.jsonl", "b.jsonl"], ["a.jsonl", "b.jsonl"]),
        (["[a.jsonl,b.jsonl]"], ["a.jsonl", "b.jsonl"]),
    ],
)
def test_a_list_of_paths_takes_one_several_or_a_list(capsys, monkeypatch, given, paths):
    """Everywhere a list of paths is taken: a recipe override and the data commands."""
    code, out = run_main(capsys, "fit", "--recipe", "treeflash_tiny", "--data.spec.paths", *given, "--print_config")
    assert code == 0 and yaml.safe_load(out)["data"]["init_args"]["spec"]["paths"] == paths
    seen = []

    def regenerate(target: str, data: list[str], output: str, max_new_tokens: int = 512) -> None:
        seen.append(data)

    monkeypatch.setitem(data_cli.COMMANDS, "regenerate", regenerate)
    main(["data", "regenerate", "--target", "t", "--data", *given, "--output", "o.jsonl", "--max_new_tokens", "4"])
    assert seen == [paths]


def test_fit_ends_with_the_table_of_the_trained_weights():
    """After fit, the table comes from a validation pass at the final step: one runs unless the last pass was
    there (a sanity check, which sees untrained weights, leaves ``validated_step`` None)."""
    from trainer.training.treeflash import TreeFlashTraining

    events = []

    class Trainer:
        global_step, is_global_zero = 20, True

        def validate(self, model, datamodule, verbose):
            events.append("validate")

    model = TreeFlashTraining.__new__(TreeFlashTraining)
    model.print_table = lambda: events.append("table")
    cli = TrainerCLI.__new__(TrainerCLI)
    cli.trainer, cli.model, cli.datamodule = Trainer(), model, None
    for validated_step, expected in [(None, "validate"), (10, "validate"), (20, "table")]:
        model.__dict__["validated_step"] = validated_step
        events.clear()
        cli.after_fit()
        assert events == [expected]


def test_progress_bar_title_in_a_run_bounded_by_steps():
    bar = StepProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=-1)
    assert bar._get_train_description(0).rstrip() == "Epoch 0"
    bar._trainer = SimpleNamespace(max_epochs=3)
    assert bar._get_train_description(1).rstrip() == "Epoch 1/2"
