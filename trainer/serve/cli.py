"""``trainer serve``: the OpenAI-compatible server with continuous batching, verifier logs and hot reload.

    trainer serve                                   # the shipped tiny target and drafter on 127.0.0.1:8000
    trainer serve --drafter checkpoints/dflash_tiny --tree ddtree --logs runs/logs --watch runs/adjacency
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "target_tiny", "prompt": "def main(", "max_tokens": 32}'

``--tree auto`` (the default) lets the cost-aware controller (trainer/decoding/controller.py) choose every step
between plain decoding, recycling and the drafter's ``--neural-tree`` builder (default: its family's own,
``NATIVE_TREES`` in trainer/decoding/builders.py) at several budgets; a builder name pins that builder at
``--budget``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path

import uvicorn
from transformers import AutoTokenizer, PreTrainedModel

from trainer.decoding.batch import BatchEngine
from trainer.decoding.builders import BUILDERS, native_tree
from trainer.decoding.controller import policy_for
from trainer.decoding.options import TreeOptions
from trainer.devices import add_device_arguments, parse_device, parse_dtype
from trainer.drafters import load_drafter
from trainer.errors import UserError
from trainer.paths import project_path
from trainer.runs import resolve_drafter
from trainer.serve.app import Limits, build_app
from trainer.serve.metrics import Metrics
from trainer.serve.worker import Worker
from trainer.target import load_causal_lm
from trainer.vlog.writer import LogWriter

DEFAULT_TARGET = "checkpoints/target_tiny"
DEFAULT_DRAFTER = "checkpoints/dflash_tiny"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainer serve", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="target HF directory (default: the shipped tiny target)")
    p.add_argument(
        "--drafter", default=DEFAULT_DRAFTER, help="drafter HF directory or training run, or 'none' (default: shipped)"
    )
    p.add_argument("--tree", default="auto", help=f"'auto' (the controller) or one of {sorted(BUILDERS)}")
    p.add_argument(
        "--neural-tree", default=None, help="the drafter's builder the controller may choose (default: its family's)"
    )
    p.add_argument("--budget", type=int, default=16, help="draft nodes per step with a fixed --tree")
    p.add_argument("--tree-opt", action="append", default=[], metavar="KEY=VALUE", help="tree option (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed at start)")
    p.add_argument("--logs", type=Path, default=None, help="write verifier logs (step + request records) here")
    p.add_argument("--log-prefix", default=None, help="segment name prefix (default: serve-PID)")
    p.add_argument("--watch", type=Path, action="append", default=[], help="published snapshot directory (repeatable)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the target's dir name)")
    p.add_argument("--max-tokens", type=int, default=1024, help="largest max_tokens a request may ask for")
    p.add_argument("--max-batch", type=int, default=16, help="requests verified together per step")
    add_device_arguments(p, "the target and the drafter (a drafter published later too)")
    return p


def load_models(args: argparse.Namespace) -> tuple[PreTrainedModel, PreTrainedModel | None]:
    """The target and the drafter (None with ``--drafter none``) the server runs, on ``--device`` in
    ``--dtype``, for inference."""
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    target = load_causal_lm(str(project_path(args.target)), dtype, device=device).eval()
    drafter = None if args.drafter == "none" else load_drafter(resolve_drafter(args.drafter)[0], dtype).to(device)
    return target, drafter


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    target_dir = project_path(args.target)
    target, drafter = load_models(args)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    options = TreeOptions.parse(args.tree_opt)
    drafter_name = None if drafter is None else Path(args.drafter).name
    if args.tree == "auto":
        neural = (args.neural_tree or native_tree(drafter)) if drafter is not None else None
    else:
        if args.tree not in BUILDERS:
            raise UserError(f"--tree {args.tree!r}: choose 'auto' or one of {sorted(BUILDERS)}")
        if args.budget < 0:
            raise UserError(f"--budget must be >= 0, got {args.budget}")
        neural = args.tree if BUILDERS[args.tree].uses_drafter else None
    policy, trees = policy_for(args.tree, args.budget, neural)
    engine = BatchEngine(target, drafter, trees, policy, options, max_batch=args.max_batch)
    for directory in args.watch:
        # A daemon started after the server publishes here first: the directory may not exist yet.
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"--watch {directory}: cannot make the directory (the daemon's --publish): {e}") from None
    writer = None
    if args.logs is not None:
        prefix = args.log_prefix or f"serve-{os.getpid()}"
        writer = LogWriter(args.logs, prefix, vocab_size=target.config.vocab_size)
    model_name = args.model_name or target_dir.name
    worker = Worker(engine, Metrics(), model_name, drafter_name, neural, writer, tuple(args.watch))
    limits = Limits(context=target.config.max_position_embeddings, max_tokens=args.max_tokens)
    app = build_app(worker, tokenizer, model_name, limits)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
        # Listening before the address is printed: a client that connects before uvicorn has started waits in
        # the backlog instead of being refused (a bound socket that does not listen refuses connections).
        sock.listen(2048)
    except OSError as e:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    worker.start()
    print(f"trainer serve: {model_name} on http://{args.host}:{sock.getsockname()[1]} (tree {args.tree})", flush=True)
    # uvicorn re-raises the SIGTERM it caught once it has shut down; exiting through SystemExit runs the
    # `finally` below, which finishes the verifier log.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        # Finishes the log segment (atomic rename) after the last request record.
        worker.stop()
