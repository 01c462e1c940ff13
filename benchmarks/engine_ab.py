"""Engines side by side in one process, stepping in strict alternation: tokens per second of engine time of fixed
speculative configurations and of the cost-aware controller, as ratios to plain decoding at concurrency 1, 4, 8
(``--concurrency``).

``benchmarks/serve.py`` measures what a client of ``trainer serve`` sees, in turns of seconds; on this 2-core
machine the CPU's speed wanders by 5-15% over seconds, so two identical servers still differ by a few percent
there. Here the engines that ``trainer serve --tree T --budget B`` would run share one target and take one step
each in turn (forward, then backward order), so every engine sees the same machine to within a step: the noise
left is that of single steps, and ratios are good to about half a percent. Each engine keeps ``concurrency``
requests live (a finished request is replaced before the next step; the first ones end after 8, 16, ... tokens so
that rows finish at different steps, as in a server) on distinct prompts (those of ``benchmarks/serve.py``) cut to
``--prompt-tokens`` tokens each (lanes that decoded at different speeds hold different prompts; of different
lengths they made a lane's steps 2-4% dearer in cache columns alone), sampled at ``--temperature`` with a seed per
request, and is charged the wall time of its own steps, admissions (prefill) included. The engines live through
the three concurrencies, as a server's engine does through changes of load (the controller keeps what it measured), with
``--warmup`` seconds of steps before each is measured. No HTTP and no tokenizer: the server's own
work per request is the same for every configuration. Ratios come with the standard error over blocks of
``--block`` seconds; a second plain engine ("plain again") is the noise control. Under each row, the controller's
steps per arm in the measured stretch (its probes and re-checks included).

    OMP_NUM_THREADS=1 python benchmarks/engine_ab.py [--seconds 60] [--configs none:0,recycling:8,auto:0] \
        [--concurrency 1,4,8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from serve import configurations, request_prompts  # benchmarks/serve.py, beside this script
from transformers import AutoTokenizer

from trainer.decoding.batch import BatchEngine, BatchRequest
from trainer.decoding.builders import native_tree
from trainer.decoding.controller import policy_for
from trainer.decoding.options import TreeOptions
from trainer.decoding.verify import Sampling
from trainer.drafters import load_drafter
from trainer.paths import project_path
from trainer.serve.worker import seeded_generator
from trainer.target import load_causal_lm


class Lane:
    """One engine and its live requests; ``step`` returns the tokens it produced and the seconds it took, and
    counts the step's arm (``"tree@budget"``) in ``arms``."""

    def __init__(
        self, engine: BatchEngine, prompts: list[list[int]], concurrency: int, max_tokens: int, temperature: float
    ) -> None:
        self.engine, self.prompts, self.concurrency = engine, prompts, concurrency
        self.max_tokens, self.temperature = max_tokens, temperature
        self.live: list[BatchRequest] = []
        self.submitted = 0
        self.arms: Counter[str] = Counter()

    def step(self) -> tuple[int, float]:
        start = time.perf_counter()
        while len(self.live) < self.concurrency:
            n = self.submitted
            max_tokens = self.max_tokens if n >= self.concurrency else 8 * (n + 1)
            request = BatchRequest(
                torch.tensor(self.prompts[n % len(self.prompts)]), max_tokens,
                Sampling(self.temperature, 1.0, 0), seeded_generator(n), frozenset(),
            )  # fmt: skip
            self.engine.submit(request)
            self.live.append(request)
            self.submitted += 1
        before = sum(len(r.tokens) for r in self.live)
        events = self.engine.step()
        seconds = time.perf_counter() - start
        if events:
            self.arms[f"{events[0].event.builder}@{events[0].event.budget}"] += 1
        tokens = sum(len(r.tokens) for r in self.live) - before
        self.live = [r for r in self.live if not r.finished]
        return tokens, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="measured seconds per concurrency (all engines)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of steps before measuring, per concurrency")
    p.add_argument("--block", type=float, default=2.0, help="seconds per block of the standard error")
    p.add_argument("--configs", default="none:0,recycling:8,recycling:16,ddtree:16,auto:0")
    p.add_argument(
        "--concurrency", default="1,4,8", help="concurrencies, in order (the engines live through all of them)"
    )
    p.add_argument("--target", default="checkpoints/target_tiny")
    p.add_argument("--drafter", default="checkpoints/dflash_tiny")
    p.add_argument(
        "--neural-tree", default=None, help="the drafter's builder the controller may choose (default: its family's)"
    )
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--per-module", type=int, default=40, help="prompts per held-out stdlib module (at most)")
    p.add_argument("--prompt-tokens", type=int, default=96, help="tokens of every prompt (the last ones)")
    p.add_argument("--control", action=argparse.BooleanOptionalAction, default=True, help="a second plain engine")
    p.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: checks that the script runs")
    args = p.parse_args()
    if args.smoke:
        args.seconds, args.warmup, args.block, args.configs = 0.4, 0.1, 0.2, "none:0,ddtree:8,auto:0"
        args.max_tokens, args.per_module, args.prompt_tokens, args.control = 8, 2, 32, False
    configs, names = configurations(args.configs, args.control)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    torch.set_grad_enabled(False)
    target = load_causal_lm(str(project_path(args.target))).eval()
    tokenizer = AutoTokenizer.from_pretrained(project_path(args.target))
    drafter = load_drafter(project_path(args.drafter))
    texts = request_prompts(args.per_module)
    # Every prompt has the same number of tokens, so a step's cost does not depend on which prompts a lane's rows
    # hold: lanes that decoded at different speeds before are at different places in the list.
    prompts = [ids[-args.prompt_tokens :] for ids in tokenizer(texts)["input_ids"] if len(ids) >= args.prompt_tokens]
    print(f"tokens per second of engine time as ratio to plain decoding (T={args.temperature}, {args.seconds:.0f} s "
          f"of alternating steps); ± the standard error over {args.block:.0f} s blocks, then the blocks' median and "
          "quartiles")  # fmt: skip
    print(f"{'concurrency':>11} {'plain tok/s':>11} " + " ".join(f"{n:>34}" for n in names[1:]))
    lanes = []
    for tree, budget in configs:
        neural = (args.neural_tree or native_tree(drafter)) if tree == "auto" else None
        policy, trees = policy_for(tree, budget, neural)
        engine = BatchEngine(target, drafter, trees, policy, TreeOptions.parse([]), max_batch=16)
        lanes.append(Lane(engine, prompts, concurrencies[0], args.max_tokens, args.temperature))
    for concurrency in concurrencies:
        for lane in lanes:
            lane.concurrency = concurrency
        totals = [[0, 0.0] for _ in lanes]
        blocks: list[list[float]] = []
        block = [[0, 0.0] for _ in lanes]
        start = block_start = time.perf_counter()
        turn = 0
        # At least one measured turn: on a loaded machine a smoke run's first turns can outlast its seconds.
        while time.perf_counter() - start < args.warmup + args.seconds or not totals[0][1]:
            measuring = time.perf_counter() - start >= args.warmup
            if not measuring:
                for lane in lanes:
                    lane.arms.clear()
            for i in range(len(lanes)) if turn % 2 == 0 else reversed(range(len(lanes))):
                tokens, seconds = lanes[i].step()
                if measuring:
                    for acc in (totals[i], block[i]):
                        acc[0] += tokens
                        acc[1] += seconds
            turn += 1
            if measuring and time.perf_counter() - block_start >= args.block:
                blocks.append([tokens / seconds for tokens, seconds in block])
                block = [[0, 0.0] for _ in lanes]
                block_start = time.perf_counter()
            elif not measuring:
                block_start = time.perf_counter()
        rates = [tokens / seconds for tokens, seconds in totals]
        cells = []
        for i in range(1, len(lanes)):
            per_block = [b[i] / b[0] for b in blocks]
            error = statistics.stdev(per_block) / len(per_block) ** 0.5 if len(per_block) > 1 else float("nan")
            # The blocks' median and quartiles too: one block with a preempted step of a lane moves the mean's error.
            low, median, high = (
                statistics.quantiles(per_block, n=4) if len(per_block) > 1 else (per_block or [float("nan")]) * 3
            )
            cells.append(f"{rates[i] / rates[0]:.3f}x ±{error:.3f} ({median:.3f} {low:.3f}-{high:.3f})".rjust(34))
        print(f"{concurrency:>11} {rates[0]:>11.1f} " + " ".join(cells), flush=True)
        # What the controller chose over the measured stretch (its probes and re-checks included).
        for name, lane in zip(names, lanes, strict=True):
            if name == "controller":
                print(f"{'':>11} controller steps: " + ", ".join(f"{a} {n}" for a, n in lane.arms.most_common()))


if __name__ == "__main__":
    main()
