"""``trainer export RUN --format FORMAT --out DIR``: write a drafter in an inference engine's layout.

On CPU, the shipped tiny DFlash backbone as the reference TreeFlash layout::

    trainer export checkpoints/dflash_tiny --format treeflash --out runs/export/treeflash_tiny

``--check vllm`` then serves the export with vLLM, from vLLM's own environment (``--vllm-python``, default
``$TRAINER_VLLM_PYTHON``; ``.ci/vllm_env`` creates one), and prints its per-position acceptance beside our
engine's (:mod:`trainer.integrations.vllm.parity`); a difference fails the command.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import torch

from trainer.devices import DTYPES
from trainer.errors import UserError
from trainer.export import FORMATS, write_export
from trainer.export.source import load_source


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainer export",
        description="Write a trained drafter in the directory layout an inference engine loads.",
    )
    parser.add_argument("run", type=Path, help="a training run directory (its newest hf/), a .ckpt or an HF dir")
    parser.add_argument("--format", required=True, choices=list(FORMATS), help="the target layout")
    parser.add_argument("--out", required=True, type=Path, help="output directory (replaced whole, atomically)")
    parser.add_argument("--target", help="the target model (path or hub id); default the run's recipe target")
    parser.add_argument("--dtype", choices=DTYPES, help="weight dtype of the export; default the drafter's own")
    parser.add_argument("--check", choices=["vllm"], help="serve the export with vLLM and compare acceptance")
    parser.add_argument("--vllm-python", type=Path, default=os.environ.get("TRAINER_VLLM_PYTHON"),
                        help="python of vLLM's environment (default $TRAINER_VLLM_PYTHON)")  # fmt: skip
    return parser


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    if args.out.resolve() == args.run.resolve():
        raise UserError(f"--out {args.out} is the source itself; choose another directory")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.check and (args.vllm_python is None or not Path(args.vllm_python).is_file()):
        raise UserError(f"--check vllm needs vLLM's python (--vllm-python or $TRAINER_VLLM_PYTHON), got "
                        f"{args.vllm_python}; create vLLM's environment with .ci/vllm_env DIR")  # fmt: skip
    source = load_source(args.run)
    target = args.target or source.target
    out = write_export(source.drafter, args.format, args.out, target, dtype)
    print(f"{args.format} export -> {out}")
    if args.check:
        if target is None:
            raise UserError("--check vllm serves the export beside its target: give --target")
        gate = [str(args.vllm_python), "-m", "trainer.integrations.vllm.parity", "--drafter", str(args.run),
                "--formats", args.format, "--export", str(out), "--target", target]  # fmt: skip
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if subprocess.run(gate, env=env, check=False).returncode:
            raise UserError(f"vLLM serving {out} does not accept as our engine does (table above)")
