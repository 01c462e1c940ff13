"""Server throughput: tokens/s of ``trainer serve`` at concurrency 1, 4 and 8 for plain decoding, fixed
speculative configurations and the cost-aware controller, as ratios to plain decoding at the same concurrency.

``--replicas`` server processes per configuration run at the same time (idle ones cost nothing); for each
concurrency every server takes turns, ``--rounds`` times, so machine noise hits all of them alike. A turn keeps
``concurrency`` clients busy and counts the tokens the server committed (its ``/metrics`` counters) over a
``--seconds`` window that starts ``--ramp`` seconds in, so neither the ramp-up nor the drain of a turn is measured.
On this 2-core machine the CPU's speed wanders by ~5% between adjacent seconds and a server process can run a few
percent slower than an identical one for its whole life (memory layout), hence short turns, many rounds and
several processes per configuration. Clients send prompts cut from held-out stdlib modules (``--per-module`` per
module, :func:`trainer.tiny.prompts.build_prompts`) with lossless sampling at ``--temperature`` (the tiny target
loops under greedy decoding, which would flatter copying drafters), each request a new prompt and seed: every
server gets the same requests in a turn, and no server sees a request twice (the 82 prompts of
``data/prompts/stdlib_heldout.jsonl`` sent again each turn under the same seeds repeated whole outputs, which
the recycling adjacency had learnt: recycling@8 measured 1.40-1.46x plain decoding at one request that way and
1.10-1.17x on new requests, and its τ at four requests was 1.65 against 1.55). A warm-up
turn per server and concurrency lets the controller measure its arms first; each round starts one server later
than the one before, and a second set of plain servers ("plain again", ``--no-control`` leaves it out) shows how
far identical configurations differ in the same run. Each ratio comes with its standard error over rounds (a
round's turns of the configuration against plain decoding's turns of the same round).

    python benchmarks/serve.py [--seconds 3] [--rounds 4] [--replicas 2] [--configs none:0,recycling:16,auto:0]
"""

from __future__ import annotations

import argparse
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from transformers import AutoTokenizer

from trainer.paths import project_path
from trainer.serve.process import ServerProcess
from trainer.tiny.prompts import build_prompts


def committed(url: str) -> float:
    """Tokens the server has produced: those its steps committed plus each request's first token (prefill)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    steps = re.search(r"^trainer_tokens_total (\S+)$", text, re.MULTILINE)
    admitted = re.search(r'^trainer_requests_total\{status="submitted"\} (\S+)$', text, re.MULTILINE)
    return sum(float(m.group(1)) for m in (steps, admitted) if m)


def configurations(text: str, control: bool) -> tuple[list[tuple[str, int]], list[str]]:
    """``tree:budget,...`` (plain decoding ``none:0`` first: ratios are to it) as (tree, budget) pairs, plain
    decoding once more at the end with ``control``; and the column name of each."""
    configs = [(c.split(":")[0], int(c.split(":")[1])) for c in text.split(",")]
    if configs[0][0] != "none":
        raise SystemExit("the first configuration must be plain decoding (none:0): ratios are to it")
    names = [f"{t}@{b}" if t != "auto" else "controller" for t, b in configs]
    if control:
        configs.append(configs[0])
        names.append("plain again")
    return configs, names


# Requests one turn may send at most (a turn of 3.5 s at eight requests sends ~25): turn t's requests are numbered
# from t * TURN_REQUESTS, so turns never share a request.
TURN_REQUESTS = 256


def request_prompts(per_module: int) -> list[str]:
    """Distinct prompts from held-out stdlib modules, ``per_module`` per module (at most)."""
    tokenizer = AutoTokenizer.from_pretrained(project_path("checkpoints/target_tiny"))
    return [row["prompt"] for row in build_prompts(tokenizer, per_module)]


def load(url: str, prompts: list[str], concurrency: int, ramp: float, seconds: float, temperature: float,
         max_tokens: int, first: int = 0) -> float:  # fmt: skip
    """Tokens per second the server at ``url`` produced between ``ramp`` and ``ramp + seconds`` while
    ``concurrency`` clients sent requests numbered from ``first`` (request ``i``: prompt ``i`` of ``prompts``,
    cyclically, and seed ``i``); the clients then finish their requests."""
    stop = threading.Event()

    def client(n: int) -> None:
        with httpx.Client(timeout=300) as http:
            i = first + n
            while not stop.is_set():
                body = {"model": "target_tiny", "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                        "temperature": temperature, "seed": i}  # fmt: skip
                http.post(f"{url}/v1/completions", json=body).raise_for_status()
                i += concurrency

    threads = [threading.Thread(target=client, args=(n,)) for n in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(ramp)
    start, start_tokens = time.perf_counter(), committed(url)
    time.sleep(seconds)
    rate = (committed(url) - start_tokens) / (time.perf_counter() - start)
    stop.set()
    for t in threads:
        t.join()
    return rate


def start_servers(arguments: dict[tuple[int, int], list[str]]) -> dict[tuple[int, int], ServerProcess]:
    """A server per key, started side by side (each start is mostly imports and loading); if one fails to start,
    the others are stopped."""
    with ThreadPoolExecutor(len(arguments)) as pool:
        futures = {key: pool.submit(ServerProcess, args) for key, args in arguments.items()}
    started = {key: f.result() for key, f in futures.items() if f.exception() is None}
    failed = [f.exception() for f in futures.values() if f.exception() is not None]
    if failed:
        for server in started.values():
            server.stop()
        raise failed[0]
    return started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0, help="measured window of a turn")
    p.add_argument("--ramp", type=float, default=0.5, help="seconds of a turn before its window opens")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--replicas", type=int, default=2, help="server processes per configuration")
    p.add_argument("--configs", default="none:0,recycling:16,ddtree:16,auto:0")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--per-module", type=int, default=40, help="prompts per held-out stdlib module (at most)")
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated numbers of concurrent clients")
    control = "a second set of plain servers taking turns like the others: its ratio is the benchmark's own noise"
    p.add_argument("--control", action=argparse.BooleanOptionalAction, default=True, help=control)
    p.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: checks that the script runs")
    args = p.parse_args()
    if args.smoke:
        args.seconds, args.ramp, args.rounds, args.replicas, args.configs = 0.3, 0.1, 1, 1, "none:0,recycling:8"
        args.max_tokens, args.per_module, args.control, args.concurrency = 8, 2, False, "1,2"
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    configs, names = configurations(args.configs, args.control)
    prompts = request_prompts(args.per_module)
    # (configuration index, replica) -> server; the control is a second set of the first configuration.
    servers = start_servers({(i, r): ["--tree", tree, "--budget", str(budget)]
                             for r in range(args.replicas) for i, (tree, budget) in enumerate(configs)})  # fmt: skip
    # (concurrency, configuration index, round) -> tokens/s of each of its replicas' turns.
    rates: dict[tuple[int, int, int], list[float]] = {}
    try:
        turn = 0
        for concurrency in concurrencies:
            turn += 1
            for server in servers.values():
                load(server.url, prompts, concurrency, args.ramp, args.seconds, args.temperature, args.max_tokens,
                     turn * TURN_REQUESTS)  # fmt: skip
            for round_ in range(args.rounds):
                turn += 1
                # Each round starts one server later, so no server always takes its turn after the same one.
                order = list(servers.items())
                order = order[round_ % len(order) :] + order[: round_ % len(order)]
                for (config, _), server in order:
                    rate = load(server.url, prompts, concurrency, args.ramp, args.seconds, args.temperature,
                                args.max_tokens, turn * TURN_REQUESTS)  # fmt: skip
                    rates.setdefault((concurrency, config, round_), []).append(rate)
    finally:
        for server in servers.values():
            server.stop()
    print(f"tokens/s as ratio to plain decoding (T={args.temperature}, {args.rounds} rounds x {args.replicas} "
          f"servers x {args.seconds:.0f} s per configuration);")  # fmt: skip
    print("± the standard error over rounds (a round's turns as ratio to plain decoding's in that round);")
    print("in brackets the lowest and highest ratio of one round's turns")
    every = range(args.rounds)
    print(f"{'concurrency':>11} {'plain tok/s':>11} " + " ".join(f"{n:>24}" for n in names[1:]))
    for concurrency in concurrencies:
        # (configuration, round) -> mean tokens/s of its turns in that round.
        rounds = {(c, r): sum(rates[concurrency, c, r]) / args.replicas for c in range(len(configs)) for r in every}
        plain = sum(rounds[0, r] for r in every) / args.rounds
        cells = []
        for c in range(1, len(configs)):
            ratio = sum(rounds[c, r] for r in every) / args.rounds / plain
            per_round = [rounds[c, r] / rounds[0, r] for r in every]
            error = statistics.stdev(per_round) / len(per_round) ** 0.5 if len(per_round) > 1 else float("nan")
            cells.append(f"{ratio:.2f}x ±{error:.2f} [{min(per_round):.2f}-{max(per_round):.2f}]".rjust(24))
        print(f"{concurrency:>11} {plain:>11.1f} " + " ".join(cells))


if __name__ == "__main__":
    main()
