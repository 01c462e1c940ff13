"""The embedded corpus: the Python standard library source of the running interpreter.

Every module (one ``.py`` file, named by its dotted path) lands in exactly one split, decided by a hash of
its name, so the split is the same on every machine whatever the order of the file system. Third-party code
(``site-packages``) never enters: it stays out-of-domain for adaptation experiments. An installed package's own
source splits by the same rule (``list_modules(split, package_root(name), name)``): the new domain a target is
fine-tuned on when it moves (``recipes/target_tiny_moved.yaml``).

Run on CPU to see the split sizes::

    python -m trainer.tiny.corpus
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainer.errors import UserError
from trainer.paths import SHIPPED_ROOT

Split = Literal["train", "validation", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "validation", "heldout")

# Percent buckets of sha1(module name) mod 100: [0, 90) train, [90, 95) validation, [95, 100) held-out.
_VALIDATION_FROM = 90
_HELDOUT_FROM = 95

_THIRD_PARTY_DIRS = {"site-packages", "dist-packages", "__pycache__"}

HELDOUT_MANIFEST = SHIPPED_ROOT / "data" / "stdlib_heldout_modules.json"


@dataclass(frozen=True)
class Module:
    name: str
    path: Path


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(module_name: str) -> Split:
    bucket = int(hashlib.sha1(module_name.encode()).hexdigest(), 16) % 100
    if bucket >= _HELDOUT_FROM:
        return "heldout"
    if bucket >= _VALIDATION_FROM:
        return "validation"
    return "train"


def package_root(package: str) -> Path:
    """The source directory of the installed package ``package``, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"'{package}' is not an installed package with a source directory")
    return Path(next(iter(spec.submodule_search_locations)))


def _module_name(root: Path, path: Path, package: str | None = None) -> str:
    parts = [package] if package else []
    parts += list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def list_modules(split: Split, root: Path | None = None, package: str | None = None) -> list[Module]:
    """All stdlib modules of ``split``, sorted by name. Excludes site-packages and unreadable files.

    With ``package``, ``root`` is that package's source directory (``package_root``) and module names start with
    the package's name."""
    root = root or stdlib_root()
    modules = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruned in place so that os.walk never descends into third-party code.
        dirnames[:] = [d for d in dirnames if d not in _THIRD_PARTY_DIRS]
        for filename in filenames:
            if not filename.endswith(".py"):
                continue
            path = Path(dirpath) / filename
            name = _module_name(root, path, package)
            if split_of(name) == split:
                modules.append(Module(name, path))
    return sorted(modules, key=lambda m: m.name)


def read_module(module: Module) -> str | None:
    """The module's source, or None when it is not valid UTF-8 (the stdlib ships a few such test files)."""
    try:
        return module.path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def write_heldout_manifest(path: Path = HELDOUT_MANIFEST) -> list[str]:
    names = [m.name for m in list_modules("heldout")]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"split_rule": "sha1(module) % 100 >= 95", "modules": names}, indent=1) + "\n")
    return names


if __name__ == "__main__":
    for split in SPLITS:
        mods = list_modules(split)
        size = sum(m.path.stat().st_size for m in mods)
        print(f"{split:>10}: {len(mods):5d} modules, {size / 1e6:6.1f} MB")
    print(f"held-out manifest: {len(write_heldout_manifest())} modules -> {HELDOUT_MANIFEST}")
