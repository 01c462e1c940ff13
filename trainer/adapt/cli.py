"""``trainer adapt graft`` and ``trainer adapt bandit``: argument parsing for the adaptation daemons (the
daemons live beside it).

trainer adapt graft --logs runs/logs --publish runs/adjacency --once
trainer adapt bandit --logs runs/logs --drafter checkpoints/dflash_tiny --publish runs/drafters --once
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from trainer.adapt import bandit_daemon, graft
from trainer.adapt.bandit import BanditConfig
from trainer.adapt.bandit_daemon import run_bandit
from trainer.adapt.graft import DEFAULT_TARGET, GraftConfig, run_graft
from trainer.devices import add_device_arguments, parse_device, parse_dtype
from trainer.errors import ArgumentParser, UserError

DEFAULTS = GraftConfig()
BANDIT = BanditConfig()


def graft_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="trainer adapt graft", description=graft.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--logs", type=Path, required=True, help="verifier log directory (segments *.jsonl[.part])")
    p.add_argument("--publish", type=Path, required=True, help="snapshot directory: PUBLISH/current, PUBLISH/vNNNNNN")
    p.add_argument("--target", default=DEFAULT_TARGET, help="target HF directory (only its config.json is read)")
    p.add_argument("--state", type=Path, default=None, help="state directory (default PUBLISH/.state)")
    p.add_argument("--once", action="store_true", help="process what is there, publish, exit (default: tail)")
    g = p.add_argument_group("aggregation")
    g.add_argument("--width", type=int, default=DEFAULTS.width, help="successors per published row (k)")
    g.add_argument("--candidates", type=int, default=DEFAULTS.candidates, help="candidates kept per row")
    g.add_argument("--rows", type=int, default=DEFAULTS.rows, help="shared rows held (default: the vocabulary)")
    g.add_argument("--tenant-rows", type=int, default=DEFAULTS.tenant_rows, help="rows held per tenant delta")
    g.add_argument("--max-tenants", type=int, default=DEFAULTS.max_tenants, help="tenant deltas held (LRU)")
    g.add_argument("--half-life", type=float, default=DEFAULTS.half_life, help="evidence half-life in log lines")
    g.add_argument("--batch-records", type=int, default=DEFAULTS.batch_records, help="log lines per batch")
    g.add_argument(
        "--replica-row-cap",
        type=float,
        default=DEFAULTS.replica_row_cap,
        help="most evidence one server adds to one row per batch (in observations of probability 1)",
    )
    g.add_argument("--prompt-weight", type=float, default=DEFAULTS.prompt_weight, help="weight of prompt evidence")
    t = p.add_argument_group("timing")
    t.add_argument("--commit-seconds", type=float, default=5.0, help="state is committed at least this often")
    t.add_argument("--publish-seconds", type=float, default=30.0, help="snapshots are published at most this often")
    t.add_argument("--poll-seconds", type=float, default=0.5, help="idle wait between looks at the log directory")
    t.add_argument("--keep", type=int, default=5, help="published versions kept on disk")
    t.add_argument(
        "--decode-workers",
        type=int,
        default=1,
        help="processes that decode log lines while the daemon aggregates (0: decode in the daemon's process)",
    )
    return p


def bandit_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="trainer adapt bandit",
        description=bandit_daemon.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--logs", type=Path, required=True, help="verifier log directory (segments *.jsonl[.part])")
    p.add_argument(
        "--drafter",
        type=Path,
        required=True,
        help="drafter HF directory or training run served first (DFlash, TreeFlash, EAGLE-3, SpecBlock)",
    )
    p.add_argument("--publish", type=Path, required=True, help="drafter versions: PUBLISH/current, PUBLISH/vNNNNNN")
    p.add_argument("--target", default=DEFAULT_TARGET, help="target HF directory (frozen; features and teacher)")
    p.add_argument("--state", type=Path, default=None, help="state directory (default PUBLISH/.state)")
    p.add_argument("--once", action="store_true", help="read what is there, decide once, exit (default: tail)")
    p.add_argument("--poll-seconds", type=float, default=1.0, help="idle wait between looks at the log directory")
    add_device_arguments(p, "the target (the drafters train in float32 on the same device)")
    g = p.add_argument_group("decision")
    for name, value in asdict(BANDIT).items():
        g.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    return p


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: trainer adapt graft --logs DIR --publish DIR [--once] (--help for all options)")
        print("       trainer adapt bandit --logs DIR --drafter DIR --publish DIR [--state DIR] [--once]")
        return
    if argv[0] == "bandit":
        args = bandit_parser().parse_args(argv[1:])
        device, dtype = parse_device(args.device), parse_dtype(args.dtype)
        if dtype is torch.float16:
            # Its candidates train under autocast; float16 gradients underflow without a loss scaler.
            raise UserError("--dtype 'float16': the bandit trains its candidates in it; use bfloat16 or float32")
        config = BanditConfig(**{name: getattr(args, name) for name in asdict(BANDIT)})
        code = run_bandit(
            args.logs, args.drafter, args.publish, args.state, args.once, args.target, config, args.poll_seconds,
            device, dtype,
        )  # fmt: skip
        if code:
            sys.exit(code)
        return
    if argv[0] != "graft":
        raise UserError(f"unknown daemon 'trainer adapt {argv[0]}'; available: graft, bandit")
    args = graft_parser().parse_args(argv[1:])
    # The aggregation's sorts and gathers are memory-bound: a second torch thread gains nothing and, beside the
    # decode workers on a small machine, stalls every operation on its barrier.
    torch.set_num_threads(1)
    config = GraftConfig(
        width=args.width,
        candidates=args.candidates,
        rows=args.rows,
        tenant_rows=args.tenant_rows,
        max_tenants=args.max_tenants,
        half_life=args.half_life,
        batch_records=args.batch_records,
        replica_row_cap=args.replica_row_cap,
        prompt_weight=args.prompt_weight,
    )
    run_graft(
        args.logs,
        args.publish,
        args.target,
        args.state,
        args.once,
        config,
        args.commit_seconds,
        args.publish_seconds,
        args.poll_seconds,
        args.keep,
        decode_workers=args.decode_workers,
    )
