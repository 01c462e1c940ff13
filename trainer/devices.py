"""Where and in what precision a command runs its models: the ``--device`` and ``--dtype`` flags that
``trainer eval``, ``trainer serve``, ``trainer adapt bandit`` and ``trainer data regenerate`` share, with one
set of choices, one default and one set of error messages. On CPU::

    python -c "import trainer.devices as d; print(d.parse_device(None), d.parse_dtype('bfloat16'))"
"""

from __future__ import annotations

import argparse

import torch

from trainer.errors import UserError

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = "cpu, cuda or cuda:N"
DEVICE_HELP = f"{DEVICES} (default: the first GPU when there is one, otherwise the CPU)"
DTYPE_HELP = f"one of {', '.join(DTYPES)} (default: float32)"


def parse_device(text: str | None) -> torch.device:
    """``--device`` as a torch device this machine has; None: the first GPU when there is one, else the CPU."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UserError(f"--device {text!r} is not a device ({DEVICES})") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {text!r}: only cpu and cuda devices are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {text!r}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"--device {text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def parse_dtype(text: str) -> torch.dtype:
    """``--dtype`` as a torch floating dtype."""
    if text not in DTYPES:
        raise UserError(f"--dtype {text!r} is not one of {', '.join(DTYPES)}")
    return getattr(torch, text)


def add_device_arguments(parser: argparse.ArgumentParser, models: str) -> None:
    """``--device`` and ``--dtype`` on an argparse command; ``models`` says what they apply to ("the target and
    the drafter"). Parse the values with :func:`parse_device` and :func:`parse_dtype`."""
    parser.add_argument("--device", default=None, help=f"device of {models}: {DEVICE_HELP}")
    parser.add_argument("--dtype", default="float32", help=f"weight dtype of {models}: {DTYPE_HELP}")
