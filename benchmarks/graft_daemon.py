"""Graft daemon throughput: tree nodes/s per ingest stage, and snapshot publish latency, for the tiny vocabulary
and a 152k one (Qwen3's 151,936).

Stages, each timed alone on the same synthetic traffic (steady state: the table is warmed first):

- aggregate: ``cap_per_replica`` + ``CandidateTable.add`` on evidence tensors (the daemon's own work);
- evidence: decoded step records -> evidence tensors (``step_evidence``);
- parse: JSON lines -> validated step columns, as the daemon reads them (``LogReader(raw=True)`` and
  ``trainer.vlog.reader.BatchDecoder``: simdjson buffers, list checks vectorised per batch);
- end to end: parse, then ``GraftState.apply_decoded``, i.e. all of the above, on one core;
- the daemon: ``trainer adapt graft --once`` (in this process) with 0, 1 and 2 decode workers, wall clock: a whole
  run, and steady ingest (a run over ``4c`` copies of the lines minus one over ``c``, runs interleaved);
- per-record validator: ``LogReader`` decoding every line to a dict with ``orjson.loads`` + ``schema.validate``
  (the reference path, which other readers use); json alone: ``orjson.loads`` of every line, nothing else.

Traffic: step records of ``--nodes`` verified nodes (root included), top-8 each, from 4 replicas; node tokens
are Zipf-distributed over the vocabulary and their top-8 mostly follow a fixed successor function (as a real
target's would), with ``--noise`` of the ids random. On CPU::

    OMP_NUM_THREADS=1 python benchmarks/graft_daemon.py
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import statistics
import tempfile
import time
from collections.abc import Callable
from itertools import islice
from pathlib import Path

import numpy as np
import orjson
import torch
from safetensors.torch import save_file

from trainer.adapt.candidates import SCALE
from trainer.adapt.graft import GraftConfig, GraftState, cap_per_replica, run_graft, step_evidence
from trainer.snapshots import ADJACENCY, ADJACENCY_TENSOR, publish
from trainer.vlog.reader import BatchDecoder, LogReader, StepColumns
from trainer.vlog.schema import step_record

CLOCK = time.process_time


def zipf_tokens(n: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Token ids with a Zipf(1.1) rank distribution; the rank -> token map is fixed (the same language in
    every batch), the draws come from ``generator``."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probs = ranks.pow(-1.1)
    sampled = torch.multinomial(probs / probs.sum(), n, replacement=True, generator=generator)
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[sampled]


def traffic(records: int, nodes: int, vocab: int, noise: float, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    tokens = zipf_tokens(records * nodes, vocab, g).view(records, nodes)
    successors = (tokens[..., None] * 31 + 7 * torch.arange(8) + 1) % vocab
    random_ids = torch.randint(0, vocab, successors.shape, generator=g)
    ids = torch.where(torch.rand(successors.shape, generator=g) < noise, random_ids, successors)
    logprobs = -0.3 - 0.6 * torch.arange(8.0) - 0.1 * torch.rand(successors.shape, generator=g)
    out = []
    for i in range(records):
        n = nodes - 1
        out.append(
            step_record(
                server=f"replica{i % 4}",
                request=f"q{i // 16}",
                tenant=None,
                shareable=True,
                step=i % 16,
                drafter="eagle3",
                drafter_version=1,
                tree="ddtree",
                budget=n,
                pos=100 + i % 16,
                root=int(tokens[i, 0]),
                tokens=tokens[i, 1:].tolist(),
                parents=[-1, *range(n - 1)],
                accepted=[0],
                bonus=int(successors[i, -1, 0]),
                topk_ids=ids[i].tolist(),
                topk_logprobs=[[round(x, 4) for x in row] for row in logprobs[i].tolist()],
                ms={"draft": 1.0, "tree": 0.1, "verify": 2.0},
            )
        )
    return out


def best_seconds(fn: Callable[[], object], repeats: int, setup: Callable[[], None] | None = None) -> float:
    """Median CPU seconds of this process (``--clock cpu``, the default: other jobs on a shared machine do
    not count) or wall seconds (``--clock wall``) of ``fn``."""
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
    return statistics.median(times)


def measure(vocab: int, args: argparse.Namespace) -> dict[str, float]:
    config = GraftConfig(batch_records=args.batch_records)
    batches = [traffic(args.batch_records, args.nodes, vocab, args.noise, seed) for seed in range(args.batches)]
    nodes = sum(len(r["tokens"]) + 1 for b in batches for r in b)
    servers = [[int(r["server"][-1]) for r in batch] for batch in batches]

    # Warm on other traffic of the same distribution: rows exist, most true successors are known. Every
    # repeat starts from a copy of that table, so no measured batch was seen before.
    warm = GraftState.fresh(vocab, config)
    for seed in range(1000, 1000 + args.warm_batches):
        batch = traffic(args.batch_records, args.nodes, vocab, args.noise, seed)
        warm.apply(batch, len(batch))
    columns = [StepColumns.from_records(b) for b in batches]
    evidence = [step_evidence(c, np.array(s), config.candidates) for c, s in zip(columns, servers, strict=True)]
    cap = round(config.replica_row_cap * SCALE)
    state = warm

    def aggregate() -> None:
        for i, e in enumerate(evidence):
            weights = cap_per_replica(e, vocab, cap)
            state.shared.add(e.rows, e.cands, weights, state.tick + i + 1)

    def convert() -> None:
        for c, s in zip(columns, servers, strict=True):
            step_evidence(c, np.array(s), config.candidates)

    def fresh_copy() -> None:
        nonlocal state
        state = copy.deepcopy(warm)

    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp) / "logs"
        logs.mkdir()
        # As LogWriter writes them: compact orjson lines (log-probs rounded to 1e-4 like StepRecorder).
        lines = "".join(orjson.dumps(r).decode() + "\n" for b in batches for r in b)
        (logs / "bench-000000-1.jsonl").write_text(lines)

        decoder = BatchDecoder(vocab)
        decoded = []

        def parse() -> None:
            decoded.clear()
            reader = iter(LogReader(logs, vocab_size=vocab, raw=True))
            while batch := list(islice(reader, args.batch_records)):
                decoded.append((decoder([item.record for item in batch]), len(batch)))

        def apply() -> None:
            for d, lines_in_batch in decoded:
                state.apply_decoded(d.steps, d.requests, lines_in_batch)

        def validator() -> None:
            for _ in LogReader(logs, vocab_size=vocab):
                pass

        raw = lines.encode().splitlines()

        def loads() -> None:
            for line in raw:
                orjson.loads(line)

        times = {
            "aggregate": best_seconds(aggregate, args.repeats, fresh_copy),
            "evidence": best_seconds(convert, args.repeats),
            "parse": best_seconds(parse, args.repeats),
            "apply": best_seconds(apply, args.repeats, fresh_copy),
            "validator": best_seconds(validator, args.repeats),
            "json": best_seconds(loads, args.repeats),
        }
        adjacency_s = best_seconds(lambda: state.shared.adjacency(config.width), args.repeats)
        matrix = state.shared.adjacency(config.width)
        pub = Path(tmp) / "pub"
        # Publishing waits on fsync: wall time is its latency, whatever --clock says.
        publish_s = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            publish(pub, lambda d: save_file({ADJACENCY_TENSOR: matrix}, d / ADJACENCY), {})
            publish_s.append(time.perf_counter() - start)
        publish_s = statistics.median(publish_s)
        mb = len(lines) / 1e6

        # The daemon itself, wall clock: --once runs over the same lines repeated (one segment a copy), with and
        # without decode workers; the state is committed once, at the end. A run reads c copies, another 4c:
        # the difference is 3c copies' worth of steady ingest, without start-up, final commit and publish (over
        # 2c copies, turn-to-turn noise of the machine moved it by up to 20%).
        vocab_file = Path(tmp) / "target"
        vocab_file.mkdir()
        (vocab_file / "config.json").write_text(f'{{"vocab_size": {vocab}}}')
        logs_of = {}
        for copies in (args.daemon_copies, 4 * args.daemon_copies):
            logs_of[copies] = Path(tmp) / f"daemon_logs{copies}"
            logs_of[copies].mkdir()
            for c in range(copies):
                (logs_of[copies] / f"bench-{c:06d}-{1000 + c}.jsonl").write_text(lines)

        def daemon_seconds(workers: int, copies: int, r: int) -> float:
            out = Path(tmp) / f"daemon{workers}_{copies}_{r}"
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                run_graft(logs_of[copies], out, vocab_file, once=True, config=config, commit_seconds=1e9,
                          decode_workers=workers)  # fmt: skip
            return time.perf_counter() - start

        daemon, steady = {}, {}
        for workers in (0, 1, 2):
            short, long = [], []
            for r in range(args.repeats):
                short.append(daemon_seconds(workers, args.daemon_copies, r))
                long.append(daemon_seconds(workers, 4 * args.daemon_copies, r))
            daemon[workers] = nodes * args.daemon_copies / statistics.median(short)
            extra = max(statistics.median(long) - statistics.median(short), 1e-9)
            steady[workers] = nodes * 3 * args.daemon_copies / extra
    return {
        "nodes": nodes,
        "log_mb": mb,
        "aggregate": nodes / times["aggregate"],
        "evidence": nodes / times["evidence"],
        "parse": nodes / times["parse"],
        "end_to_end": nodes / (times["parse"] + times["apply"]),
        "validator": nodes / times["validator"],
        "json": nodes / times["json"],
        "adjacency_ms": adjacency_s * 1e3,
        "publish_ms": publish_s * 1e3,
        "rows_held": state.shared.held(),
        "daemon": daemon,
        "steady": steady,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", default="8192,151936")
    p.add_argument("--nodes", type=int, default=32, help="verified nodes per step record (root included)")
    p.add_argument("--batch-records", type=int, default=1024)
    p.add_argument("--batches", type=int, default=4, help="measured batches")
    p.add_argument("--warm-batches", type=int, default=4, help="batches of other traffic applied first")
    p.add_argument("--noise", type=float, default=0.2, help="share of top-k ids that are random")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--daemon-copies", type=int, default=6, help="copies of the measured lines the daemon reads")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="CPU time of this process, or wall time")
    p.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: checks that the script runs")
    args = p.parse_args()
    if args.smoke:
        args.vocabs, args.batch_records, args.batches, args.warm_batches = "8192", 64, 1, 1
        args.repeats, args.daemon_copies = 1, 2
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    print(
        f"{args.batches} batches x {args.batch_records} step records x {args.nodes} nodes, top-8, 4 replicas; "
        f"{args.clock} time, one thread"
    )
    stages = ("aggregate", "evidence", "parse", "end_to_end", "validator", "json")
    header = (
        f"{'V':>8} {'aggregate':>12} {'evidence':>12} {'parse':>12} {'end to end':>12} {'per-record':>12} "
        f"{'json alone':>12}  (nodes/s)"
    )
    print(header)
    results = {}
    for vocab in (int(v) for v in args.vocabs.split(",")):
        r = results[vocab] = measure(vocab, args)
        rates = " ".join(f"{r[k]:>12,.0f}" for k in stages)
        print(f"{vocab:>8} {rates}")
    print("\nthe daemon, wall clock, nodes/s: a whole --once run (start-up, reading, decoding, aggregating, one")
    print("commit, a publish), and steady ingest (the difference between a run over 4x the lines and one run)")
    print(f"{'V':>8} {'in-process':>12} {'1 worker':>12} {'2 workers':>12} | steady: {'in-process':>12} "
          f"{'1 worker':>12} {'2 workers':>12}")  # fmt: skip
    for vocab, r in results.items():
        whole = " ".join(f"{r['daemon'][w]:>12,.0f}" for w in (0, 1, 2))
        print(f"{vocab:>8} {whole} |         " + " ".join(f"{r['steady'][w]:>12,.0f}" for w in (0, 1, 2)))
    print("\nshare of end-to-end time per stage, and publish latency")
    for vocab, r in results.items():
        total = 1 / r["end_to_end"]
        shares = {k: (1 / r[k]) / total for k in ("parse", "evidence", "aggregate")}
        print(
            f"V={vocab}: parse {shares['parse']:.0%} · evidence {shares['evidence']:.0%} · aggregate "
            f"{shares['aggregate']:.0%} · per-record validator {(1 / r['validator']) / total:.0%} · "
            f"aggregate/parse speed {r['aggregate'] / r['parse']:.1f}x · "
            f"adjacency {r['adjacency_ms']:.1f} ms + publish {r['publish_ms']:.1f} ms (wall) "
            f"({r['rows_held']} rows held)"
        )


if __name__ == "__main__":
    main()
