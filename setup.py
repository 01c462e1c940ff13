"""Packaging beside pyproject.toml: the shipped assets travel inside the wheel.

The repository keeps ``checkpoints/``, ``data/`` and ``recipes/`` at its top level; a wheel installs them as
``trainer/shipped/{checkpoints,data,recipes}``, where ``trainer.paths.SHIPPED_ROOT`` finds them. Built with
``pip wheel --no-deps -w dist .``; the tiny checkpoints make it about 14 MB.
"""

from setuptools import find_packages, setup

# Top-level directory -> the files of it that ship (globs relative to it). data/cache/ (local corpora) does not.
SHIPPED = {
    "checkpoints": ["**/*"],
    "data": ["*.json", "prompts/*.jsonl"],
    "recipes": ["*.yaml"],
}

setup(
    packages=find_packages(include=["trainer", "trainer.*"]) + [f"trainer.shipped.{d}" for d in SHIPPED],
    package_dir={f"trainer.shipped.{d}": d for d in SHIPPED},
    package_data={f"trainer.shipped.{d}": globs for d, globs in SHIPPED.items()},
)
