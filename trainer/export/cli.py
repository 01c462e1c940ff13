"""``trainer export RUN --format FORMAT --out DIR``: write a drafter in an inference engine's layout.

On CPU, the shipped tiny DFlash backbone as the reference TreeFlash layout::

    trainer export checkpoints/dflash_tiny --format treeflash --out runs/export/treeflash_tiny
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from trainer.devices import DTYPES
from trainer.errors import UserError
from trainer.export import FORMATS, export


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
    return parser


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    if args.out.resolve() == args.run.resolve():
        raise UserError(f"--out {args.out} is the source itself; choose another directory")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = export(args.run, args.format, args.out, target=args.target, dtype=dtype)
    print(f"{args.format} export -> {out}")
