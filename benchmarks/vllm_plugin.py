"""What the vLLM plugin's verifier log costs vLLM, and how long a drafter swap takes.

1. Overhead: vLLM (in process, fp32, greedy) serves the shipped tiny target with the EAGLE-3 export and decodes the
   same held-out prompts as one batch, in a fresh process per run, with and without ``TRAINER_VLLM_LOG_DIR``,
   alternating which goes first. Greedy decoding takes the same steps both ways, so the wall time of
   ``generate`` compares directly; the paired ratio (logged / unlogged) is printed per pair with the median.
   The log writer thread's CPU time (top-k, validation, JSON, I/O) is counted directly beside it: the cost when
   no core is spare. The machine is shared: read the spread across pairs before the median.
2. Swap: the time of each hot swap of a published drafter version (the plugin's own measurement: load, convert,
   check, in-place reload), over ``--swaps`` versions published while vLLM serves.

Run in vLLM's environment (``.ci/vllm_env``)::

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_plugin.py --pairs 3 [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUN = """
import json, os, sys, time
from pathlib import Path
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams
from trainer.evaluate import read_prompts
target, export = sys.argv[1:3]
limit, max_tokens, swaps = map(int, sys.argv[3:6])
tok = AutoTokenizer.from_pretrained(target)
rows = read_prompts(Path("data/prompts/stdlib_heldout.jsonl"))[:limit]
prompts = [{"prompt_token_ids": tok(r["prompt"], add_special_tokens=False)["input_ids"]} for r in rows]
llm = LLM(target, dtype="float32", enforce_eager=True, async_scheduling=False, max_model_len=512, seed=0,
          kv_cache_memory_bytes=1 << 28,
          speculative_config={"model": export, "method": "eagle3", "num_speculative_tokens": 3})
params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
from trainer.integrations.vllm import hooks
writer = hooks._installed._writer if hooks._installed is not None else None
cpu = writer.cpu_seconds() if writer is not None else 0.0
start = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
result = {"seconds": time.perf_counter() - start}
if writer is not None:
    result["writer_cpu"] = writer.cpu_seconds() - cpu
if swaps:
    from trainer.snapshots import publish
    from trainer.drafters import load_drafter
    drafter = load_drafter("checkpoints/eagle3_tiny")
    for _ in range(swaps):
        publish(Path(os.environ["TRAINER_VLLM_WATCH"]), drafter.save_pretrained, {"kind": "drafter"})
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    result["swap_ms"] = hooks._installed.reloader.swap_ms
print(json.dumps(result))
"""


def run(export: Path, logs: Path | None, watch: Path | None, args: argparse.Namespace) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for name in ("TRAINER_VLLM_LOG_DIR", "TRAINER_VLLM_WATCH"):
        env.pop(name, None)
    if logs is not None:
        env["TRAINER_VLLM_LOG_DIR"] = str(logs)
    if watch is not None:
        env["TRAINER_VLLM_WATCH"], env["TRAINER_VLLM_POLL_SECONDS"] = str(watch), "0.001"
    swaps = args.swaps if watch is not None else 0
    command = [sys.executable, "-c", RUN, args.target, str(export), str(args.limit), str(args.max_tokens), str(swaps)]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(ROOT / "checkpoints/target_tiny"))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--swaps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="one pair of 2 prompts x 8 tokens, one swap")
    args = parser.parse_args()
    if args.smoke:
        args.pairs, args.limit, args.max_tokens, args.swaps = 1, 2, 8, 1
    from trainer.export import export

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        drafter = export(ROOT / "checkpoints/eagle3_tiny", "speculators", tmp / "export", target=args.target)
        ratios = []
        for pair in range(args.pairs):
            logs = tmp / f"logs{pair}"
            order = [None, logs] if pair % 2 == 0 else [logs, None]
            runs = {str(o): run(drafter, o, None, args) for o in order}
            plain, logged = runs["None"]["seconds"], runs[str(logs)]["seconds"]
            ratio = logged / plain
            ratios.append(ratio)
            writer = runs[str(logs)]["writer_cpu"] / plain
            print(f"pair {pair}: unlogged {plain:.2f} s, logged {logged:.2f} s, ratio {ratio:.3f}; "
                  f"log writer thread CPU {writer:.3f} of the unlogged wall time")  # fmt: skip
        print(f"logging overhead: median ratio {statistics.median(ratios):.3f} over {len(ratios)} pairs")
        swap_ms = run(drafter, None, tmp / "pub", args)["swap_ms"]
        each = [round(m, 1) for m in swap_ms]
        print(f"swap: {len(swap_ms)} swaps, ms {each}, median {statistics.median(swap_ms):.1f}")


if __name__ == "__main__":
    main()
