"""Regeneration speed of the two engines in one run: tokens/s of ``generate_batch`` (HF) and of vLLM's offline
engine on the same prompts, batch for batch as ``trainer data regenerate --batch_size`` groups them, and their ratio.

Prompts are windows of held-out stdlib code; the replies are greedy (so the two engines write the same tokens,
which is checked and printed) and capped at ``--max_new_tokens`` (the tiny target rarely stops). Load and start-up
times are left out and reported apart; each engine writes once untimed first. Runs in vLLM's environment, which has
transformers too; on CPU with the tiny target::

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python \\
        benchmarks/data_engines.py --prompts 32 --batch_size 8 --max_new_tokens 64
"""

from __future__ import annotations

import time

import torch

from trainer.data.regenerate import generate_batch, load_target, text_stops
from trainer.data.vllm_engine import VllmGenerator
from trainer.errors import ArgumentParser
from trainer.tiny.corpus import list_modules


def windows(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens: the first window of each held-out stdlib module long enough."""
    prompts = []
    for module in list_modules("heldout"):
        ids = tokenizer(module.path.read_text(), add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == n:
            return prompts
    raise SystemExit(f"only {len(prompts)} held-out modules have {length} tokens; ask for fewer --prompts")


def timed(write, prompts: list[list[int]], batch_size: int) -> tuple[list[list[int]], float]:
    """Every batch's replies and the seconds they took in all."""
    replies, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        replies += [ids for ids, _ in write(prompts[i : i + batch_size])]
    return replies, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="benchmarks/data_engines.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="checkpoints/target_tiny")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt_tokens", type=int, default=64)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--smoke", action="store_true", help="4 prompts of 16 tokens, 8 new: seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.prompt_tokens, args.max_new_tokens, args.batch_size = 4, 16, 8, 2

    start = time.perf_counter()
    model, tokenizer = load_target(args.target, args.dtype, torch.device("cpu"))
    hf_load = time.perf_counter() - start
    stops = text_stops(tokenizer)
    prompts = windows(tokenizer, args.prompts, args.prompt_tokens)

    def hf(batch: list[list[int]]) -> list[tuple[list[int], bool]]:
        return generate_batch(model, batch, stops, args.max_new_tokens)

    timed(hf, prompts[: args.batch_size], args.batch_size)
    hf_replies, hf_seconds = timed(hf, prompts, args.batch_size)

    start = time.perf_counter()
    generator = VllmGenerator(args.target, args.dtype)
    vllm_start = time.perf_counter() - start

    def vllm(batch: list[list[int]]) -> list[tuple[list[int], bool]]:
        return generator(batch, stops.ids, args.max_new_tokens)

    timed(vllm, prompts[: args.batch_size], args.batch_size)
    vllm_replies, vllm_seconds = timed(vllm, prompts, args.batch_size)

    hf_tokens, vllm_tokens = sum(map(len, hf_replies)), sum(map(len, vllm_replies))
    same = sum(a == b for a, b in zip(hf_replies, vllm_replies, strict=True))
    hf_rate, vllm_rate = hf_tokens / hf_seconds, vllm_tokens / vllm_seconds
    print(
        f"{args.prompts} prompts of {args.prompt_tokens} tokens, batch {args.batch_size}, up to {args.max_new_tokens} "
        f"new tokens, greedy, {args.dtype}, {torch.get_num_threads()} torch threads\n"
        f"| engine | tokens | seconds | tokens/s | load/start-up s |\n|---|---|---|---|---|\n"
        f"| hf | {hf_tokens} | {hf_seconds:.2f} | {hf_rate:.0f} | {hf_load:.1f} |\n"
        f"| vllm | {vllm_tokens} | {vllm_seconds:.2f} | {vllm_rate:.0f} | {vllm_start:.1f} |\n"
        f"vllm / hf tokens/s: {vllm_rate / hf_rate:.2f}x; greedy replies equal: {same}/{len(prompts)}"
    )


if __name__ == "__main__":
    main()
