"""The ``trainer`` command: ``trainer fit|validate --recipe NAME|PATH [--key.sub value ...]``.

Built on LightningCLI, so the recipe is a LightningCLI config whose schema is the typed signatures of the
trainer, the LightningModule and the DataModule. Recipes and overrides are checked before anything is built;
a mistake prints one screen that names the recipe file, the key, and the closest valid key, and exits 2. A run
prints only what a user should read (``quiet_libraries``, ``StepProgressBar``).
"""

from __future__ import annotations

import difflib
import logging
import re
import sys
import warnings
from argparse import ArgumentError
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from rich.console import Console
from transformers.utils import logging as hf_logging

from trainer.data.prepare import data_tokenizer
from trainer.errors import UserError
from trainer.recipes import (
    Override,
    RecipeError,
    available_recipes,
    check_keys,
    join_list_values,
    load_recipe,
    parse_overrides,
    recipe_list_keys,
    resolve_recipe,
)
from trainer.training.frozen_target import FrozenTargetTraining

COMMANDS = {
    "fit": "train a model from a recipe (resume with --ckpt_path last|PATH)",
    "validate": "run the validation loop of a recipe on a checkpoint (--ckpt_path PATH)",
    "data": "data jobs: `trainer data regenerate` (target-written responses), `trainer data cache` (features)",
    "eval": "a drafter in lossless speculative decoding: τ, speed-up, acceptance by depth (--help)",
    "serve": "an OpenAI-compatible server: continuous batching, verifier logs, hot reload (--help)",
    "adapt": "deployment daemons: `trainer adapt graft --logs DIR --publish DIR` (adjacency matrix from logs)",
    "export": "a drafter in an engine's layout: --format dflash|treeflash|speculators|sglang|specblock (--help)",
}

USAGE = """usage: trainer fit|validate --recipe NAME|PATH [--key.sub VALUE ...] [--print_config]
       trainer data regenerate|cache --help
       trainer eval --drafter RUN|DIR --prompts FILE --tree NAME[,NAME] --budget N[,N] --out DIR

commands:
{commands}

A bare recipe name is looked up in ./recipes and in the package's recipes/ (.yaml optional).
Overrides use the recipe's dotted keys: --trainer.max_steps 20 --model.lr 1e-3 --data.batch_size 4.
recipes: {recipes}
"""


def quiet_libraries() -> None:
    """Silence what other libraries print and we cannot change at its source, each with the one line that says
    why it is harmless (messages of our own are fixed where they arise); every command calls this once."""
    # The frozen target is in eval mode on purpose (it never trains; dropout stays off): Lightning counts its
    # modules and warns at every fit start.
    warnings.filterwarnings("ignore", r"Found \d+ module\(s\) in eval mode", PossibleUserWarning)
    # Lightning's own pytree helper calls torch's deprecated LeafSpec check; inside Lightning, no effect on us.
    warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # transformers draws a bar per checkpoint load and save; the tiny checkpoints take a blink, and the run's
    # own progress bar reports the run.
    hf_logging.disable_progress_bar()
    # Lightning advertises its cloud logger at every fit start: nothing for a user of this toolkit to act on.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_an_advert)


def _not_an_advert(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("💡 Tip")


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, whose title reads "Epoch 0/-2" in a run bounded by steps (Lightning sets
    ``max_epochs = -1`` there); such a run's title is the epoch alone."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 0:
            description = description.replace(f"/{max_epochs - 1}", "", 1).ljust(len(description))
        return description


class TrainerCLI(LightningCLI):
    """LightningCLI whose parse step first checks the recipe's keys and rewrites jsonargparse's errors."""

    def __init__(self, command: str, recipe_path: Path, recipe: dict[str, Any], args: list[str]) -> None:
        self._command = command
        self._recipe_path = recipe_path
        self._recipe = recipe
        self._overrides = parse_overrides(args[3:])
        super().__init__(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=[*args, *tokenizer_args(recipe, self._overrides)],
            parser_kwargs={"exit_on_error": False},
            save_config_kwargs={"overwrite": True},
        )

    def parse_arguments(self, parser: Any, args: Any) -> None:
        sub = self._subcommand_parsers[self._command]
        keys = {a.dest for a in sub._actions if isinstance(a.dest, str)}
        check_keys(self._recipe, self._overrides, self._recipe_path, keys)
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as e:
            raise RecipeError(explain_parse_error(str(e), self._recipe_path)) from None
        config = self.config[self._command]
        if self._command == "validate" and not config.get("ckpt_path"):
            raise UserError("trainer validate needs --ckpt_path PATH|last: validating untrained weights says nothing")
        if config.get("ckpt_path") == "last":
            config.ckpt_path = str(last_checkpoint(Path(config.trainer.default_root_dir or ".")))

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """The trainer, with :class:`StepProgressBar` unless the recipe brings a progress bar or disables it."""
        config = self._get(self.config_init, "trainer", default={})
        callbacks = config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            kwargs["callbacks"] = [*callbacks, StepProgressBar()]
        return super().instantiate_trainer(**kwargs)

    def after_fit(self) -> None:
        """A drafter's run ends with the validation table of its trained weights: unless the last validation
        pass ran at the final step, one more runs now (``trainer validate`` prints the table itself)."""
        if not isinstance(self.model, FrozenTargetTraining):
            return
        if self.model.validated_step != self.trainer.global_step:
            self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
        elif self.trainer.is_global_zero:
            self.model.print_table()


def tokenizer_args(recipe: dict[str, Any], overrides: list[Override]) -> list[str]:
    """The override that sets the data tokenizer to the target's when the recipe (with its overrides) leaves
    it unset; a tokenizer other than the target's fails here, before anything loads (``data_tokenizer``)."""

    def setting(group: str, key: str) -> Any:
        for ov in reversed(overrides):
            if ov.key in (f"{group}.{key}", f"{group}.init_args.{key}"):
                return ov.value
        node: Any = recipe.get(group)
        for part in ("init_args", *key.split(".")):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    target = setting("model", "target")
    if target is None or not isinstance(setting("data", "spec"), dict):
        return []
    tokenizer = setting("data", "spec.tokenizer")
    return ["--data.init_args.spec.tokenizer", target] if data_tokenizer(tokenizer, target) != tokenizer else []


def last_checkpoint(root: Path) -> Path:
    """The newest whole checkpoint of any run under ``root`` (checkpoints are written atomically, so a kill
    during a save leaves the previous one newest); an error, not a silent fresh start, when there is none."""
    # A sharded checkpoint is a directory (FSDP2: with meta.pt; DeepSpeed: with latest); one being written is
    # NAME.ckpt.partial.
    found = [
        p
        for p in root.glob("**/checkpoints/*.ckpt")
        if p.is_file() or (p / "meta.pt").is_file() or (p / "latest").is_file()
    ]
    if not found:
        raise UserError(f"--ckpt_path last: no checkpoint under {root}; start without --ckpt_path to train anew")
    return max(found, key=lambda p: p.stat().st_mtime_ns)


def explain_parse_error(message: str, recipe_path: Path) -> str:
    """jsonargparse's nested union report, reduced to the offending dotted key and the expectation."""
    keys = re.findall(r'Parser key "([^"]+)"', message)
    expected = [ln.strip() for ln in message.splitlines() if ln.strip().startswith(("Expected a", "Option", "Not"))]
    if keys and expected:
        return f"invalid value for '{'.'.join(keys)}' (recipe {recipe_path}): {expected[0]}"
    head = "\n".join(message.splitlines()[:8])
    return f"invalid recipe {recipe_path}:\n{head}"


def _split_recipe_arg(rest: list[str]) -> tuple[str | None, list[str]]:
    for i, arg in enumerate(rest):
        if arg == "--recipe":
            if i + 1 >= len(rest):
                raise RecipeError("--recipe needs a recipe name or path")
            return rest[i + 1], rest[:i] + rest[i + 2 :]
        if arg.startswith("--recipe="):
            return arg.split("=", 1)[1], rest[:i] + rest[i + 1 :]
    return None, rest


def _usage() -> str:
    commands = "\n".join(f"  {name:<10} {text}" for name, text in COMMANDS.items())
    return USAGE.format(commands=commands, recipes=", ".join(available_recipes()) or "(none)")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The recipe is passed to LightningCLI as `args`; its warning about also seeing sys.argv does not apply.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    quiet_libraries()
    err = Console(stderr=True, highlight=False)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return
    command, rest = argv[0], argv[1:]
    try:
        if command not in COMMANDS:
            close = difflib.get_close_matches(command, COMMANDS, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise UserError(f"unknown command '{command}'.{hint} Commands: {', '.join(COMMANDS)}")
        if command == "data":
            from trainer.data.cli import main as data_main

            data_main(rest)
            return
        if command == "eval":
            from trainer.evaluate import main as eval_main

            eval_main(rest)
            return
        if command == "serve":
            from trainer.serve.cli import main as serve_main

            serve_main(rest)
            return
        if command == "adapt":
            from trainer.adapt.cli import main as adapt_main

            adapt_main(rest)
            return
        if command == "export":
            from trainer.export.cli import main as export_main

            export_main(rest)
            return
        recipe_name, rest = _split_recipe_arg(rest)
        if recipe_name is None:
            if "-h" in rest or "--help" in rest:
                LightningCLI(
                    LightningModule,
                    LightningDataModule,
                    subclass_mode_model=True,
                    subclass_mode_data=True,
                    args=[command, "--help"],
                )
            raise UserError(f"trainer {command} needs --recipe NAME|PATH\n\n{_usage()}")
        recipe_path = resolve_recipe(recipe_name)
        recipe = load_recipe(recipe_path)
        rest = join_list_values(rest, recipe_list_keys(recipe))
        TrainerCLI(command, recipe_path, recipe, [command, "--config", str(recipe_path), *rest])
    except UserError as e:
        err.print(f"[bold red]trainer {command}:[/] {e}", markup=True, soft_wrap=True)
        sys.exit(2)
