"""Server throughput: tokens/s of ``trainer serve`` at concurrency 1, 4 and 8 for plain decoding, fixed
speculative configurations and the cost-aware controller, as ratios to plain decoding at the same concurrency.

One server per configuration runs at the same time (idle ones cost nothing); for each concurrency the
configurations take turns, ``--rounds`` times, ``--seconds`` each, so machine noise hits all of them alike.
Clients send held-out stdlib prompts with lossless sampling at ``--temperature`` (the tiny target loops under
greedy decoding, which would flatter copying drafters) and count completion tokens. A warm-up turn per
configuration and concurrency lets the controller measure its arms first; each round starts one configuration
later than the one before (identical plain engines taking turns in process measured 0.95-1.07x each other), and
a second plain server ("plain again", ``--no-control`` leaves it out) shows how far two identical servers differ
in the same run.

    python benchmarks/serve.py [--seconds 20] [--rounds 2] [--configs none:0,recycling:16,ddtree:16,auto:0]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import httpx

from trainer.paths import project_path
from trainer.serve.process import ServerProcess

CONCURRENCY = (1, 4, 8)


def load(url: str, prompts: list[str], concurrency: int, seconds: float, temperature: float, max_tokens: int) -> float:
    """Completion tokens per second of ``concurrency`` clients looping over ``prompts`` for ``seconds``."""
    tokens = [0] * concurrency
    stop_at = time.time() + seconds

    def client(n: int) -> None:
        with httpx.Client(timeout=300) as http:
            i = n
            while time.time() < stop_at:
                body = {"model": "target_tiny", "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                        "temperature": temperature, "seed": i}  # fmt: skip
                response = http.post(f"{url}/v1/completions", json=body)
                response.raise_for_status()
                tokens[n] += response.json()["usage"]["completion_tokens"]
                i += concurrency

    start_time = time.time()
    threads = [threading.Thread(target=client, args=(n,)) for n in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.time() - start_time)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--configs", default="none:0,recycling:16,ddtree:16,auto:0")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=Path, default=project_path("data/prompts/stdlib_heldout.jsonl"))
    control = "a second plain server taking turns like the others: its ratio is the benchmark's own noise"
    p.add_argument("--control", action=argparse.BooleanOptionalAction, default=True, help=control)
    args = p.parse_args()
    configs = [(c.split(":")[0], int(c.split(":")[1])) for c in args.configs.split(",")]
    if configs[0][0] != "none":
        raise SystemExit("the first configuration must be plain decoding (none:0): ratios are to it")
    if args.control:
        configs.append(configs[0])
    prompts = [json.loads(line)["prompt"][-400:] for line in args.prompts.read_text().splitlines() if line.strip()]
    # Keyed by position: the control is a second server of the first configuration.
    servers = {i: ServerProcess(["--tree", c[0], "--budget", str(c[1])]) for i, c in enumerate(configs)}
    rates: dict[tuple[int, int], list[float]] = {}
    try:
        for concurrency in CONCURRENCY:
            for server in servers.values():
                load(server.url, prompts, concurrency, args.seconds / 2, args.temperature, args.max_tokens)
            for round_ in range(args.rounds):
                # Each round starts one configuration later, so no configuration always follows the same one.
                order = list(servers.items())
                order = order[round_ % len(order) :] + order[: round_ % len(order)]
                for config, server in order:
                    rate = load(server.url, prompts, concurrency, args.seconds, args.temperature, args.max_tokens)
                    rates.setdefault((concurrency, config), []).append(rate)
    finally:
        for server in servers.values():
            server.stop()
    names = [f"{t}@{b}" if t != "auto" else "controller" for t, b in configs]
    if args.control:
        names[-1] = "plain again"
    print(f"tokens/s as ratio to plain decoding (T={args.temperature}, {args.rounds} x {args.seconds:.0f} s);")
    print("in brackets the lowest and highest ratio of one round's turns")
    print(f"{'concurrency':>11} {'plain tok/s':>11} " + " ".join(f"{n:>18}" for n in names[1:]))
    for concurrency in CONCURRENCY:
        plain_rates = rates[concurrency, 0]
        plain = sum(plain_rates) / len(plain_rates)
        cells = []
        for c in range(1, len(configs)):
            rounds = [rate / base for rate, base in zip(rates[concurrency, c], plain_rates, strict=True)]
            mean = sum(rates[concurrency, c]) / len(rates[concurrency, c]) / plain
            cells.append(f"{mean:.2f}x [{min(rounds):.2f}-{max(rounds):.2f}]".rjust(18))
        print(f"{concurrency:>11} {plain:>11.1f} " + " ".join(cells))


if __name__ == "__main__":
    main()
