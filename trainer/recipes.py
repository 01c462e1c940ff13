"""Recipes: finding them by name, and checking their keys before anything heavy is built.

A recipe is a LightningCLI config: ``trainer``, ``model`` / ``data`` as ``class_path`` + ``init_args``, and
the other top-level keys of the subcommand. The typed signatures of those classes are the only schema; this
module reads them to name a wrong key, where it is (recipe file or command line) and the closest valid key,
so that a typo fails in milliseconds with one screen of text instead of after a model load.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import json
import os
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any

import yaml

from trainer.errors import UserError
from trainer.paths import SHIPPED_ROOT

PACKAGE_RECIPES = SHIPPED_ROOT / "recipes"


class RecipeError(UserError):
    """A recipe or override that cannot run; the message is complete and meant for the user."""


def available_recipes(dirs: Iterable[Path] | None = None) -> list[str]:
    names: set[str] = set()
    for d in dirs or _recipe_dirs():
        names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def _recipe_dirs() -> list[Path]:
    dirs = [Path.cwd() / "recipes", PACKAGE_RECIPES]
    return [d for i, d in enumerate(dirs) if d.is_dir() and d.resolve() not in {x.resolve() for x in dirs[:i]}]


def resolve_recipe(name: str) -> Path:
    """A path as given (``.yaml`` optional), else a bare name in ``./recipes`` or the package's ``recipes/``."""
    candidates = [Path(name), Path(f"{name}.yaml")]
    if "/" not in name:
        for d in _recipe_dirs():
            candidates += [d / name, d / f"{name}.yaml"]
    for path in candidates:
        if path.is_file():
            return Path(os.path.relpath(path)) if path.resolve().is_relative_to(Path.cwd()) else path
    known = available_recipes()
    close = difflib.get_close_matches(Path(name).stem, known, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise RecipeError(f"recipe '{name}' not found.{hint}\nAvailable recipes: {', '.join(known) or '(none)'}")


def load_recipe(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe {path} is not valid YAML:\n{e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path} must be a mapping of keys (trainer, model, data, ...), not {type(data)}")
    return data


@dataclass(frozen=True)
class Override:
    key: str
    value: str | None


def parse_overrides(args: list[str]) -> list[Override]:
    """``--a.b value`` / ``--a.b=value`` pairs; a flag followed by another flag or nothing has no value."""
    out: list[Override] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise RecipeError(f"unexpected argument '{arg}': overrides look like --trainer.max_steps 20")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            out.append(Override(key, value))
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append(Override(arg[2:], args[i + 1]))
            i += 2
        else:
            out.append(Override(arg[2:], None))
            i += 1
    return out


def list_keys(fn: Any) -> set[str]:
    """Dotted names of the list-typed parameters of ``fn`` (a function or a class), descending into
    dataclass groups: ``{"data"}`` for ``regenerate``, ``{"layers", "spec.paths"}`` for ``cache_features``."""
    hints = typing.get_type_hints(fn.__init__ if inspect.isclass(fn) else fn)
    return {key for name, hint in hints.items() if name != "return" for key in _list_leaves(hint, name)}


def _list_leaves(annotation: Any, key: str) -> set[str]:
    fields = _nested_fields(annotation)
    if fields is not None:
        return {k for name, hint in fields.items() for k in _list_leaves(hint, f"{key}.{name}")}
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, UnionType) else ()
    return {key} if list in {typing.get_origin(a) for a in (annotation, *options)} else set()


def recipe_list_keys(recipe: dict[str, Any]) -> set[str]:
    """The overrides of a recipe that take a list, as ``group.key`` and ``group.init_args.key``."""
    keys = set()
    for group in ("model", "data"):
        node = recipe.get(group)
        params = _class_params(str(node["class_path"])) if isinstance(node, dict) and "class_path" in node else None
        for name, hint in params[0].items() if params else ():
            keys |= {k for key in _list_leaves(hint, name) for k in (f"{group}.{key}", f"{group}.init_args.{key}")}
    return keys


def join_list_values(args: list[str], keys: set[str]) -> list[str]:
    """``--key a b`` and ``--key a`` as ``--key '["a", "b"]'`` for the list-typed ``keys``, so that a list of
    paths is given the way a shell lists files; a value written as a list (``'[a, b]'``) stays as it is."""
    out: list[str] = []
    i = 0
    while i < len(args):
        start, arg = i, args[i]
        i += 1
        key, sep, inline = arg[2:].partition("=")
        if not arg.startswith("--") or key not in keys:
            out.append(arg)
            continue
        values = [inline] if sep else []
        while not sep and i < len(args) and not args[i].startswith("--"):
            values.append(args[i])
            i += 1
        if not values or (len(values) == 1 and values[0].lstrip().startswith("[")):
            out += args[start:i]
        else:
            out += [f"--{key}", json.dumps(values)]
    return out


def _class_params(class_path: str) -> tuple[dict[str, Any], bool] | None:
    """Init parameters of ``class_path`` (name → annotation) and whether it takes arbitrary ``**kwargs``; None if
    it cannot be imported. An ``__init__`` that takes ``**kwargs`` passes them on to its base class's, whose
    parameters are then the class's too (as LightningCLI reads them)."""
    module_name, _, attr = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError):
        return None
    names: dict[str, Any] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        hints = typing.get_type_hints(klass.__init__)
        params = [p for p in inspect.signature(klass.__init__).parameters.values() if p.name != "self"]
        for p in params:
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                names.setdefault(p.name, hints.get(p.name))
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return names, False
    return names, True


def _nested_fields(annotation: Any) -> dict[str, Any] | None:
    """Field name → annotation when ``annotation`` is a dataclass (a typed nested group), else None."""
    if dataclasses.is_dataclass(annotation):
        hints = typing.get_type_hints(annotation)
        return {f.name: hints.get(f.name) for f in dataclasses.fields(annotation)}
    return None


def _unknown(key: str, valid: Iterable[str], where: str, recipe: Path, full_key: str) -> RecipeError:
    valid = sorted(set(valid))
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    prefix = full_key[: -len(key)]
    if close:
        hint = f"did you mean: {prefix}{close[0]}"
    else:
        hint = f"valid keys under '{prefix.rstrip('.') or '(top level)'}': {', '.join(valid)}"
    return RecipeError(f"unknown key '{full_key}' {where} (recipe {recipe})\n  {hint}")


def check_keys(recipe: dict[str, Any], overrides: list[Override], recipe_path: Path, parser_keys: set[str]) -> None:
    """Raise RecipeError naming the first key of the recipe or the overrides that the schema does not know.

    ``parser_keys`` are the dotted destinations of the subcommand's parser (``trainer.max_steps``,
    ``seed_everything``, ``model``, ...). ``model`` / ``data`` subtrees are checked against the signature of
    their ``class_path``; an override may drop ``init_args`` (``--model.hidden_size`` means
    ``--model.init_args.hidden_size``), as LightningCLI allows.
    """
    parser_keys = {k for k in parser_keys if k != "help" and not k.endswith(".help")}
    top_level = {k.split(".")[0] for k in parser_keys}
    class_paths = {
        group: str(recipe[group]["class_path"])
        for group in ("model", "data")
        if isinstance(recipe.get(group), dict) and "class_path" in recipe[group]
    }
    for ov in overrides:
        for group in ("model", "data"):
            if ov.key == f"{group}.class_path" and ov.value:
                class_paths[group] = ov.value

    def check(key: str, where: str) -> None:
        parts = key.split(".")
        head = parts[0]
        if head not in top_level:
            raise _unknown(head, top_level, where, recipe_path, head)
        if head in class_paths and len(parts) > 1:
            rest = parts[2:] if parts[1] == "init_args" else parts[1:]
            if parts[1] in ("class_path", "dict_kwargs") or not rest:
                return
            params = _class_params(class_paths[head])
            if params is None:
                raise RecipeError(f"{head}.class_path '{class_paths[head]}' cannot be imported (recipe {recipe_path})")
            fields, takes_kwargs = params
            if takes_kwargs:
                return
            offset = len(parts) - len(rest)
            # Walk down typed dataclass groups (e.g. data.spec.max_length) as far as they go.
            for depth, name in enumerate(rest):
                if fields is None:
                    return
                if name not in fields:
                    raise _unknown(name, fields, where, recipe_path, ".".join(parts[: offset + depth + 1]))
                fields = _nested_fields(fields[name])
            return
        if key in parser_keys or len(parts) == 1:
            return
        # A nested key is valid when some prefix of it is a parser destination holding an object.
        for n in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:n])
            if prefix in parser_keys and not any(k.startswith(prefix + ".") for k in parser_keys):
                return
        group_keys = [k[len(head) + 1 :] for k in parser_keys if k.startswith(head + ".")]
        raise _unknown(".".join(parts[1:]), group_keys, where, recipe_path, key)

    for key in _flatten(recipe, class_paths):
        check(key, "in the recipe file")
    for ov in overrides:
        if ov.key in ("print_config", "config"):
            continue
        check(ov.key, f"in the override --{ov.key}")


def _flatten(tree: dict[str, Any], class_paths: dict[str, str]) -> list[str]:
    """Dotted keys of the recipe; ``model``/``data`` descend one level into ``init_args`` only."""
    keys: list[str] = []
    for key, value in tree.items():
        if key in class_paths and isinstance(value, dict):
            for sub, subval in value.items():
                if sub == "init_args" and isinstance(subval, dict):
                    keys += _dotted(subval, f"{key}.init_args")
                else:
                    keys.append(f"{key}.{sub}")
        elif isinstance(value, dict) and "class_path" not in value and key == "trainer":
            keys += [f"{key}.{sub}" for sub in value]
        else:
            keys.append(key)
    return keys


def _dotted(tree: dict[str, Any], prefix: str) -> list[str]:
    """Every leaf path of a nested mapping (the checker decides how deep the schema goes)."""
    keys = []
    for k, v in tree.items():
        path = f"{prefix}.{k}"
        keys += _dotted(v, path) if isinstance(v, dict) and v else [path]
    return keys
