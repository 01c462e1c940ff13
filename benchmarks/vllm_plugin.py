"""What the vLLM plugin's verifier log costs vLLM, what one step's hook costs, and how long a drafter swap stalls.

1. Overhead: vLLM (in process, fp32, greedy) serves the shipped tiny target with the EAGLE-3 export and decodes the
   same held-out prompts as one batch, ``--reps`` pairs of batches in one process with the plugin logging in one
   batch of each pair and not in the other (its configuration swapped between batches; the first of a pair
   alternates). Pairs of fresh processes measured a process-to-process spread of ±20% on this machine, which
   hides any logging cost; alternating inside one process shares the process's memory layout and neighbours.
   Greedy decoding takes the same steps both ways (checked), so a pair's ratio is its logged batch's wall time
   over its unlogged one's. A run prints the median ratio and the spread; ``--runs`` repeats the whole
   measurement in fresh processes and prints how far the runs' medians lie apart (within 2% of each other: the
   measurement resolves about 2%). The log writer thread's CPU time (the CPU top-k, validation, JSON, I/O) is
   counted beside it, as a share of the unlogged wall time: the cost when no core is spare.
2. Hook cost per step, inside the logged processes: the plugin's work on vLLM's engine thread (``DeviceTop``, the
   top-k reduction on the logits' device, and ``Plugin.log_steps``, the step records) timed against the whole step
   (``GPUModelRunner.execute_model`` + ``sample_tokens``, the plugin's hooks included), both wrapped with
   ``perf_counter`` by the benchmark's child process (the package is not changed).
3. Synthetic, at a real vocabulary (V = 151,936, 256 rows, random fp32 logits on the CPU, plain torch): the
   reduction the plugin runs now (``DeviceTop(logits, 8)``: only (256, 8) crosses to the host) against the old
   approach (a full fp32 host copy on the engine thread, then ``log_softmax`` and the top-k on the writer thread)
   and against vLLM's own greedy sampling of the same logits (``argmax``). On a CPU the "host copy" is a memcpy;
   on a GPU it is a device-to-host transfer of the same size.
4. Swap: drafter versions published while vLLM serves (``--swaps``: the tiny EAGLE-3 drafter), each waited for
   (tiny ``generate`` calls until the plugin serves it): ``Reloader.swap_ms``, the engine thread's stall (the
   in-place copy only), and ``Reloader.prepare_ms``, the load, conversion and check on the reload thread.
   ``--big-head`` repeats it with a random EAGLE-3 drafter of EAGLE-3-8B's head shape (hidden 4096, one decoder
   layer, intermediate 14336, 32 / 8 KV heads, draft vocabulary 32000) over a random 3-layer target of hidden
   4096 (vocabulary 32000, the tiny target's tokenizer; three layers: vLLM takes EAGLE-3's three features at three
   distinct layer boundaries), in ``--dtype``; it takes minutes and about 10 GB of memory in fp32.

Run in vLLM's environment (``.ci/vllm_env``) on an idle machine::

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_plugin.py --runs 2 --reps 30 [--big-head]
    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_plugin.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC_VOCAB, SYNTHETIC_ROWS, SYNTHETIC_K = 151_936, 256, 8

# One vLLM process: warm-up, ``reps`` timed batch generates, then ``swaps`` published versions waited for.
CHILD = """
import json, os, shutil, statistics, sys, time
from pathlib import Path
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams
from trainer.evaluate import read_prompts
cfg = json.loads(sys.argv[1])
tok = AutoTokenizer.from_pretrained(cfg["target"])
rows = read_prompts(Path("data/prompts/stdlib_heldout.jsonl"))[: cfg["limit"]]
prompts = [{"prompt_token_ids": tok(r["prompt"], add_special_tokens=False)["input_ids"]} for r in rows]
llm = LLM(cfg["target"], dtype=cfg["dtype"], enforce_eager=True, async_scheduling=False, max_model_len=512, seed=0,
          kv_cache_memory_bytes=1 << 28,
          speculative_config={"model": cfg["export"], "method": "eagle3", "num_speculative_tokens": 3})
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from trainer.integrations.vllm import hooks
plugin = hooks._installed
clock = {"step": 0.0, "steps": 0, "top": 0.0, "tops": 0, "log": 0.0}

def timed(owner, name, key, count=None):
    # Wraps what is there now: after LLM(), so the plugin's hooks are inside the timed call.
    original = getattr(owner, name)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            clock[key] += time.perf_counter() - start
            if count is not None:
                clock[count] += 1
    setattr(owner, name, wrapper)

timed(GPUModelRunner, "execute_model", "step", "steps")
timed(GPUModelRunner, "sample_tokens", "step")
logged = plugin is not None and plugin.config.log_dir is not None
if logged:
    timed(hooks, "DeviceTop", "top", "tops")
    timed(hooks.Plugin, "log_steps", "log")
result = {}
if cfg["reps"]:
    # Logging on and off alternate inside this one process (the plugin's configuration swapped between batches:
    # off, its hooks hand vLLM's calls straight through), so both sides share the process's memory layout, caches
    # and neighbours; the first of each pair alternates.
    import dataclasses
    on, off = plugin.config, dataclasses.replace(plugin.config, log_dir=None)
    params = SamplingParams(max_tokens=cfg["max_tokens"], temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    writer = plugin.writer
    seconds, tokens, clocks, cpu = {"on": [], "off": []}, set(), {}, 0.0
    for pair in range(cfg["reps"]):
        for mode in (("on", "off") if pair % 2 else ("off", "on")):
            plugin.config = on if mode == "on" else off
            clock.update(step=0.0, steps=0, top=0.0, tops=0, log=0.0)
            before = writer.cpu_seconds()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds[mode].append(time.perf_counter() - start)
            if mode == "on":
                cpu += writer.cpu_seconds() - before
            tokens.add(tuple(tuple(o.outputs[0].token_ids) for o in outputs))
            for key, value in clock.items():
                clocks.setdefault(mode, {}).setdefault(key, 0.0)
                clocks[mode][key] += value
    plugin.config = on
    result.update(seconds=seconds, same_tokens=len(tokens) == 1, clocks=clocks, writer_cpu=cpu,
                  plugin_errors=dict(plugin.errors))
else:
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # warm-up
if cfg["swaps"]:
    from trainer.snapshots import publish
    source, watch, reloader = Path(cfg["source"]), Path(os.environ["TRAINER_VLLM_WATCH"]), plugin.reloader

    def payload(directory):
        for f in source.iterdir():
            if f.is_file():
                shutil.copy(f, directory / f.name)

    applied, apply = [], reloader.apply

    def recording_apply():
        version = apply()
        if version is not None:
            applied.append(version)
        return version

    reloader.apply = recording_apply  # the plugin calls self.reloader.apply() between steps
    small = SamplingParams(max_tokens=2, temperature=0)
    waited = []
    for _ in range(cfg["swaps"]):
        version = publish(watch, payload, {"kind": "drafter"}, keep=2)
        start = time.perf_counter()
        while reloader.version != version:
            if version in reloader.refused or plugin.errors:
                sys.exit(f"version {version} not applied: refused {sorted(reloader.refused)}, errors {plugin.errors}")
            if time.perf_counter() - start > cfg["timeout"]:
                import faulthandler
                faulthandler.dump_traceback(all_threads=True)  # where the reload thread is
                sys.exit(f"version {version} not applied after {cfg['timeout']} s")
            llm.generate(prompts[:1], small, use_tqdm=False)
            time.sleep(0.01)
        waited.append(time.perf_counter() - start)
    result.update(swap_ms=reloader.swap_ms, prepare_ms=reloader.prepare_ms, waited_s=waited, applied=applied)
print(json.dumps(result))
"""


def child(cfg: dict, logs: Path | None = None, watch: Path | None = None, poll: float = 0.05) -> dict:
    """Run :data:`CHILD` in a fresh process (the plugin configured by ``logs`` and ``watch``); its JSON result."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for name in list(env):
        if name.startswith("TRAINER_VLLM_"):
            del env[name]
    if logs is not None:
        env["TRAINER_VLLM_LOG_DIR"] = str(logs)
    if watch is not None:
        env["TRAINER_VLLM_WATCH"], env["TRAINER_VLLM_POLL_SECONDS"] = str(watch), str(poll)
    command = [sys.executable, "-c", CHILD, json.dumps(cfg)]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        ours = "\n".join(line for line in out.stdout.splitlines() if "trainer" in line)
        raise SystemExit(f"benchmark child failed ({out.returncode}):\n{ours[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{min(values):.3f}..{max(values):.3f}" if len(values) > 1 else "one value"


def overhead_run(run: int, export: Path, tmp: Path, args: argparse.Namespace) -> float:
    """One measurement in a fresh process: ``--reps`` pairs of batches, logging on and off alternating; prints the
    pairs, the hook cost per step and the writer thread's share; returns the median pair ratio."""
    cfg = dict(target=args.target, export=str(export), dtype="float32", limit=args.limit, max_tokens=args.max_tokens,
               reps=args.reps, swaps=0)  # fmt: skip
    result = child(cfg, tmp / f"logs{run}")
    on, off = result["seconds"]["on"], result["seconds"]["off"]
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    median = statistics.median(ratios)
    clocks = result["clocks"]
    same = "same" if result["same_tokens"] else "DIFFERENT"
    errors = f"; plugin errors {result['plugin_errors']}" if result["plugin_errors"] else ""
    print(f"run {run}: batches logged {statistics.median(on):.3f} s (range {spread(on)}), unlogged "
          f"{statistics.median(off):.3f} s (range {spread(off)}); {clocks['on']['steps'] / len(on):g} steps a batch, "
          f"{same} tokens every batch; log writer thread CPU {result['writer_cpu'] / sum(off):.3f} of the unlogged "
          f"wall time{errors}", flush=True)  # fmt: skip
    print(f"run {run}: logging overhead: median ratio {median:.3f} over {len(ratios)} alternating pairs "
          f"(pairs {spread(ratios)})", flush=True)  # fmt: skip
    steps = clocks["on"]["steps"]
    top, log = 1000 * clocks["on"]["top"] / steps, 1000 * clocks["on"]["log"] / steps
    step, plain_step = 1000 * clocks["on"]["step"] / steps, 1000 * clocks["off"]["step"] / clocks["off"]["steps"]
    print(f"run {run}: hook cost per step: DeviceTop {top:.3f} ms + log_steps {log:.3f} ms = {top + log:.3f} ms of a "
          f"{step:.2f} ms logged step (hook/step {(top + log) / step:.3f}); unlogged step {plain_step:.2f} ms, "
          f"logged/unlogged step {step / plain_step:.3f}", flush=True)  # fmt: skip
    return median


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def synthetic(reps: int) -> None:
    """The top-k reduction at a real vocabulary: DeviceTop against the old host copy + log_softmax + top-k."""
    import torch

    from trainer.integrations.vllm.records import ROW_CHUNK, DeviceTop
    from trainer.sampling import top_rows

    generator = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(SYNTHETIC_ROWS, SYNTHETIC_VOCAB, generator=generator)
    k = SYNTHETIC_K
    raw = logits.to("cpu", torch.float32, copy=True)
    with torch.no_grad():
        DeviceTop(logits, k), top_rows(raw.float().log_softmax(-1), k), logits.argmax(-1)  # warm-up
        new = median_ms(lambda: DeviceTop(logits, k), reps)
        # DeviceTop's two passes over the logits: the top-k, and the log-sum-exp in chunks of ROW_CHUNK rows.
        top = median_ms(lambda: top_rows(logits, k), reps)
        lse = median_ms(lambda: [torch.logsumexp(rows, -1) for rows in logits.split(ROW_CHUNK)], reps)
        copy = median_ms(lambda: logits.to("cpu", torch.float32, copy=True), reps)
        reduce = median_ms(lambda: top_rows(raw.float().log_softmax(-1), k), reps)
        argmax = median_ms(lambda: logits.argmax(-1), reps)
    old = copy + reduce
    print(f"synthetic V={SYNTHETIC_VOCAB}, {SYNTHETIC_ROWS} rows, k={k}, fp32 on CPU ({torch.get_num_threads()} "
          f"threads, median of {reps}): the reduction where the logits are (DeviceTop's work on a GPU, and on a CPU "
          f"without a free copy slot) {new:.1f} ms (top-k {top:.1f} + log-sum-exp {lse:.1f}) | a full copy {copy:.1f} "
          f"ms (what a CPU's engine thread pays; a GPU's old device-to-host transfer) + log_softmax/top-k "
          f"{reduce:.1f} ms (the old writer-thread work) = {old:.1f} ms | argmax {argmax:.1f} ms; "
          f"reduction/old {new / old:.3f}, reduction/copy {new / copy:.3f}, reduction/argmax {new / argmax:.3f}",
          flush=True)  # fmt: skip


def swaps(label: str, cfg: dict, watch: Path) -> None:
    result = child(cfg, watch=watch)
    swap, prepare, applied = result["swap_ms"], result["prepare_ms"], result["applied"]
    twice = " (a version applied more than once)" if len(set(applied)) < len(applied) else ""
    print(f"swap: {len(result['waited_s'])} published, {len(swap)} swaps of versions {applied}{twice} ({label}): "
          f"engine-thread stall (in-place copy) ms {[round(m, 1) for m in swap]}, "
          f"median {statistics.median(swap):.1f}; off-thread prepare (load, convert, check) ms "
          f"{[round(m, 1) for m in prepare]}, median {statistics.median(prepare):.1f}; "
          f"publish to served s {[round(s, 2) for s in result['waited_s']]}", flush=True)  # fmt: skip


def build_big_head(tmp: Path, dtype_name: str) -> tuple[Path, Path, Path]:
    """A random target of hidden 4096 (3 layers, vocabulary 32000, the tiny target's tokenizer), a random EAGLE-3
    drafter of EAGLE-3-8B's head shape over it (our HF layout: the published versions) and its speculators export.
    Returns (target, drafter, export)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trainer.drafters.eagle3 import Eagle3DraftModel, build_config
    from trainer.export import write_export

    dtype = getattr(torch, dtype_name)
    vocab = 32_000
    tiny = ROOT / "checkpoints/target_tiny"
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    if len(tokenizer) > vocab:
        raise SystemExit(f"the tiny target's tokenizer has {len(tokenizer)} ids, more than the big target's {vocab}")
    target_dir, drafter_dir = tmp / "big_target", tmp / "big_drafter"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=4096, intermediate_size=1024, num_hidden_layers=3,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id or 0,
                         eos_token_id=tokenizer.eos_token_id or 0, pad_token_id=0)  # fmt: skip
    target = LlamaForCausalLM(config).to(dtype)
    target.save_pretrained(target_dir)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, target_dir / f.name)
    drafter = Eagle3DraftModel(build_config(config, draft_vocab_size=vocab, target_layer_ids=[0, 1, 2],
                                            intermediate_size=14_336)).to(dtype)  # fmt: skip
    del target
    drafter.save_pretrained(drafter_dir)
    export = write_export(drafter, "speculators", tmp / "big_export", str(target_dir))
    params = sum(p.numel() for p in drafter.parameters())
    print(f"big head: drafter {params / 1e6:.0f} M parameters in {dtype_name} (hidden 4096, intermediate 14336, "
          f"32/8 heads, draft vocabulary {vocab}) over a random 3-layer target of hidden 4096", flush=True)  # fmt: skip
    return target_dir, drafter_dir, export


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(ROOT / "checkpoints/target_tiny"))
    parser.add_argument("--runs", type=int, default=2, help="repeat the overhead measurement; medians compared")
    parser.add_argument("--reps", type=int, default=30, help="pairs of batches (logged, unlogged) per run")
    parser.add_argument("--limit", type=int, default=8, help="prompts in the batch")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--swaps", type=int, default=5)
    parser.add_argument("--synthetic-reps", type=int, default=7)
    parser.add_argument("--big-head", action="store_true", help="also the swap of an EAGLE-3-8B-shaped head")
    parser.add_argument("--big-swaps", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="of the big head case")
    parser.add_argument("--smoke", action="store_true", help="1 run of 2 pairs, 2 prompts x 8 tokens, 1 swap")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.reps, args.limit, args.max_tokens = 1, 2, 2, 8
        args.swaps, args.synthetic_reps, args.big_head = 1, 2, False
    from trainer.export import export

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        drafter = export(ROOT / "checkpoints/eagle3_tiny", "speculators", tmp / "export", target=args.target)
        medians = [overhead_run(run, drafter, tmp, args) for run in range(args.runs)]
        if len(medians) > 1:
            apart = max(medians) / min(medians) - 1
            print(f"runs: median ratios {', '.join(f'{m:.3f}' for m in medians)}; relative difference "
                  f"{100 * apart:.1f}% ({'within' if apart <= 0.02 else 'NOT within'} 2%)", flush=True)  # fmt: skip
        synthetic(args.synthetic_reps)
        tiny = dict(target=args.target, export=str(drafter), dtype="float32", limit=1, max_tokens=2, reps=0,
                    swaps=args.swaps, source=str(ROOT / "checkpoints/eagle3_tiny"), timeout=120)  # fmt: skip
        swaps("tiny EAGLE-3, fp32", tiny, tmp / "pub")
        if args.big_head:
            target, source, export_dir = build_big_head(tmp, args.dtype)
            big = dict(target=str(target), export=str(export_dir), dtype=args.dtype, limit=1, max_tokens=2, reps=0,
                       swaps=args.big_swaps, source=str(source), timeout=600)  # fmt: skip
            swaps(f"EAGLE-3-8B head shape, {args.dtype}", big, tmp / "pub_big")


if __name__ == "__main__":
    main()
