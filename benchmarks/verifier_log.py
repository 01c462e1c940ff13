"""What the verifier log costs: its share of a decoding step, writer throughput, reader + validator throughput.

1. Overhead: the shipped tiny target and DFlash drafter decode the same held-out prompts greedily with the
   DDTree builder, without and with the logging hook (``StepRecorder`` on a ``LogWriter``), alternating which
   goes first; greedy decoding takes the same steps both ways, so milliseconds per step compare directly.
   Reported side by side: the hook's time on the decoding thread (the engine's ``log`` phase), the paired
   difference of whole steps in wall time (which also holds what the writer thread costs the decoding thread:
   GIL, CPU), the paired difference in process CPU time with the writer thread's work included (the cost
   when no core is spare), and the logging CPU counted directly (the hook's thread CPU time, the writer
   thread's, and what greedy verification's top-k at the log's width costs over the top-1 it needs itself),
   which does not carry the other runs' noise but misses indirect costs (caches) that the paired difference
   holds. Paired shares come with their quartiles over pairs: on a loaded machine their spread is
   wider than the effect, so repeat the run (``--repeats``) before reading a median.
2. Writer: step records of ``budget`` draft nodes (k = 8) written until ``close`` returns: records/s (wall
   and per CPU-second), MB/s.
3. Reader: ``LogReader`` with the validator over those segments: verified tree nodes (N + 1 rows per step
   record) per second and per CPU-second, for the tiny vocabulary and for a 152k one.

Ratios, not absolute times, are the result (the machine is shared). On CPU::

    OMP_NUM_THREADS=1 python benchmarks/verifier_log.py --budgets 16,64
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.decoding.builders import BUILDERS, make_session
from trainer.decoding.engine import generate
from trainer.decoding.events import StepEvent
from trainer.drafters import load_drafter
from trainer.sampling import top_rows
from trainer.vlog.reader import LogReader
from trainer.vlog.recorder import StepRecorder
from trainer.vlog.schema import MIN_TOPK, step_record
from trainer.vlog.writer import LogWriter


def load(args: argparse.Namespace) -> tuple:
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    drafter = load_drafter(args.drafter)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    lines = args.prompts.read_text().splitlines()[: args.prompts_n]
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"][-96:]  # noqa: E731
    return target, drafter, [torch.tensor(encode(json.loads(line)["prompt"])) for line in lines]


def overhead(args: argparse.Namespace, models: tuple, budget: int, log_dir: Path) -> dict:
    target, drafter, prompts = models
    builder = BUILDERS["ddtree"]
    vocab = target.config.vocab_size
    plain_ms, logged_ms, hook_ms, plain_cpu, logged_cpu, direct_cpu = [], [], [], [], [], []
    writer = LogWriter(log_dir, f"bench{budget}", vocab_size=target.config.vocab_size, max_deferred=args.max_deferred)
    with writer:

        def run(prompt: torch.Tensor, name: str | None) -> tuple:
            hook = None
            # CPU seconds spent logging, counted directly: the hook's on the decoding thread, the writer thread's.
            logging = [-writer.cpu_seconds()]
            if name is not None:
                recorder = StepRecorder(writer, server="bench", request=name, tenant=None, shareable=True,
                                        drafter=args.drafter, drafter_version=None)  # fmt: skip

                def hook(event: StepEvent) -> None:
                    start = time.thread_time()
                    recorder(event)
                    logging[0] += time.thread_time() - start

            session = make_session("ddtree", target, drafter)
            cpu = time.process_time()
            g = generate(
                target, session, builder, prompt, args.max_new_tokens, budget, on_step=hook, step_topk=MIN_TOPK
            )
            if hook is not None:
                recorder.finish(prompt.tolist(), g.tokens)
                # The writer thread's work counts in the CPU time (all threads of the process).
                writer.flush()
            return g, time.process_time() - cpu, logging[0] + writer.cpu_seconds()

        run(prompts[0], None)  # warm-up
        for rep in range(args.repeats):
            for i, prompt in enumerate(prompts):
                order = [None, f"{rep}/{i}"] if (rep + i) % 2 == 0 else [f"{rep}/{i}", None]
                results = {name is None: run(prompt, name) for name in order}
                (plain, plain_s, _), (logged, logged_s, logging_s) = results[True], results[False]
                assert plain.tokens == logged.tokens, "logging changed the output"
                steps = len(logged.steps)
                plain_ms.append(1000 * plain.decode_seconds / steps)
                logged_ms.append(1000 * logged.decode_seconds / steps)
                hook_ms.append(1000 * sum(s.seconds.get("log", 0.0) for s in logged.steps) / steps)
                plain_cpu.append(1000 * plain_s / steps)
                logged_cpu.append(1000 * logged_s / steps)
                # Timed apart, after the pair: what verification spent on the log's top-k width.
                logging_s += sum(topk_increment(s.tree_size + 1, vocab) for s in logged.steps)
                direct_cpu.append(1000 * logging_s / steps)
    plain = statistics.median(plain_ms)
    hook = statistics.median(hook_ms)
    return {
        "plain": plain,
        "logged": statistics.median(logged_ms),
        "hook": hook,
        "hook_share": hook / plain,
        "wall_share": paired(plain_ms, logged_ms),
        "cpu_share": paired(plain_cpu, logged_cpu),
        "plain_cpu": statistics.median(plain_cpu),
        "log_cpu": statistics.median(b - a for a, b in zip(plain_cpu, logged_cpu, strict=True)),
        "direct_cpu": statistics.median(direct_cpu),
        "direct_share": statistics.median(d / p for d, p in zip(direct_cpu, plain_cpu, strict=True)),
    }


@functools.cache
def topk_increment(rows: int, vocab: int) -> float:
    """CPU seconds that greedy verification spends for the log on (rows, vocab) logits: its top-k at the log's
    width (``StepEvent.top_ids``) against the top-1 it needs itself; timed warm, apart from the measured steps."""
    logits = torch.randn(rows, vocab)
    seconds = {}
    for k in (1, MIN_TOPK):
        times = []
        for _ in range(200):
            start = time.thread_time()
            top_rows(logits, k)
            times.append(time.thread_time() - start)
        seconds[k] = statistics.median(times)
    return max(seconds[MIN_TOPK] - seconds[1], 0.0)


def paired(plain: list[float], logged: list[float]) -> tuple[float, float, float]:
    """Median and quartiles of (logged - plain) / plain per pair, so that machine load common to both runs of
    a pair cancels; the quartiles show how much the rest of the load moved it."""
    q1, median, q3 = statistics.quantiles(((y - x) / x for x, y in zip(plain, logged, strict=True)), n=4)
    return median, q1, q3


def share(q: tuple[float, float, float]) -> str:
    return f"{q[0]:+.1%} [{q[1]:+.1%}, {q[2]:+.1%}]"


def synthetic_records(n: int, nodes: int, vocab: int, seed: int) -> list[dict]:
    """Step records shaped like the engine's: a random tree of ``nodes`` draft nodes, k = 8, log-probs to 1e-4."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        parents = [-1] + [rng.randrange(-1, j) for j in range(1, nodes)]
        records.append(
            step_record(server="bench", request=f"r{i // 32}", tenant=None, shareable=True, step=i % 32,
                        drafter="dflash", drafter_version=1, tree="ddtree", budget=nodes, pos=100 + i,
                        root=rng.randrange(vocab), tokens=[rng.randrange(vocab) for _ in range(nodes)],
                        parents=parents, accepted=[0], bonus=rng.randrange(vocab),
                        topk_ids=[[rng.randrange(vocab) for _ in range(8)] for _ in range(nodes + 1)],
                        topk_logprobs=[sorted((-round(rng.random() * 10, 4) for _ in range(8)), reverse=True)
                                       for _ in range(nodes + 1)],
                        ms={"draft": 1.5, "tree": 0.25, "verify": 6.0})
        )  # fmt: skip
    return records


def throughput(records: list[dict], vocab: int, directory: Path) -> dict:
    """Wall and CPU (all threads) rates of writing ``records`` and of reading them back validated."""
    wall, cpu = time.perf_counter(), time.process_time()
    with LogWriter(directory, "tp", max_bytes=16 << 20, vocab_size=vocab) as writer:
        for r in records:
            writer.write(r)
    write_wall, write_cpu = time.perf_counter() - wall, time.process_time() - cpu
    size = sum(f.stat().st_size for f in directory.glob("*.jsonl"))
    wall, cpu = time.perf_counter(), time.process_time()
    rows = bad = 0
    for item in LogReader(directory, vocab_size=vocab):
        if isinstance(item.record, dict):
            rows += len(item.record["topk_ids"])
        else:
            bad += 1
    read_wall, read_cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert bad == 0
    return {
        "records_s": len(records) / write_wall,
        "records_cpu_s": len(records) / write_cpu,
        "mb_s": size / write_wall / 1e6,
        "nodes_s": rows / read_wall,
        "nodes_cpu_s": rows / read_cpu,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="checkpoints/target_tiny")
    p.add_argument("--drafter", default="checkpoints/dflash_tiny")
    p.add_argument("--prompts", type=Path, default=Path("data/prompts/stdlib_heldout.jsonl"))
    p.add_argument("--prompts-n", type=int, default=4)
    p.add_argument("--budgets", default="16,64")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--records", type=int, default=4000)
    p.add_argument("--max-deferred", type=int, default=8, help="LogWriter.max_deferred (0: reduce on the hook)")
    p.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: checks that the script runs")
    args = p.parse_args()
    if args.smoke:
        args.prompts_n, args.budgets, args.max_new_tokens, args.repeats, args.records = 2, "8", 8, 1, 50
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    budgets = [int(b) for b in args.budgets.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        print("logging overhead per decoding step (greedy, ddtree, tiny target; medians over prompts x repeats)")
        print(f"(max_deferred = {args.max_deferred}: 0 reduces the logits on the decoding thread; shares: median "
              "[quartiles] over pairs)")  # fmt: skip
        print("| budget | plain ms/step | logged ms/step | wall: (logged - plain) / plain | hook ms/step "
              "| hook / step | plain CPU ms/step | logging CPU ms/step | CPU: (logged - plain) / plain "
              "| logging CPU counted ms/step | counted / plain CPU |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        models = load(args)
        for budget in budgets:
            r = overhead(args, models, budget, Path(tmp) / "overhead")
            print(f"| {budget} | {r['plain']:.2f} | {r['logged']:.2f} | {share(r['wall_share'])} | {r['hook']:.3f} "
                  f"| {r['hook_share']:.1%} | {r['plain_cpu']:.2f} | {r['log_cpu']:.3f} "
                  f"| {share(r['cpu_share'])} | {r['direct_cpu']:.3f} | {r['direct_share']:.1%} |")  # fmt: skip

        print("\nwriter and reader + validator throughput (synthetic step records, k = 8; CPU = per CPU-second)")
        print("| vocab | draft nodes | writer records/s | writer records/CPU-s | writer MB/s | reader nodes/s "
              "| reader nodes/CPU-s |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for vocab in (8192, 151936):
            for budget in budgets:
                records = synthetic_records(args.records, budget, vocab, seed=budget)
                r = throughput(records, vocab, Path(tmp) / f"tp-{vocab}-{budget}")
                print(f"| {vocab} | {budget} | {r['records_s']:,.0f} | {r['records_cpu_s']:,.0f} | {r['mb_s']:.1f} "
                      f"| {r['nodes_s']:,.0f} | {r['nodes_cpu_s']:,.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
