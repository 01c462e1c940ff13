"""Feature pipeline benchmark: offline cache reads vs raw Arrow reads, online features vs a bare forward.

Builds a feature cache of held-out stdlib code with the shipped tiny target, then measures side by side in
one run (ratios, not absolute times, are the evidence on a noisy machine):

- read: iterating the cache through ``DraftData`` batches (memory-mapped float16 views, padded batches) as a
  ratio to reading the same Arrow files raw with pyarrow into numpy;
- online: ``online_features`` (hooks, 4-D packed mask, top-k of the log-softmax) as a ratio to a bare
  forward of the same target on the same batches;
- bytes per token on disk, and the same figure computed for Qwen3-8B (36 layers, H = 4096) at 4k context.

    python benchmarks/data_features.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from transformers import AutoModelForCausalLM

from trainer.data.cache import FeatureCache, cache_features
from trainer.data.features import online_features
from trainer.data.prepare import DataSpec
from trainer.paths import project_path
from trainer.target import Target
from trainer.tiny.corpus import list_modules
from trainer.training.datamodule import DraftData

TARGET = str(project_path("checkpoints/target_tiny"))
LAYERS = [1, 4, 7]
TOPK = 32


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def raw_arrow_read(root: Path) -> int:
    touched = 0
    for path in sorted(root.rglob("train/shard-*.arrow")):
        table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
        for name in table.column_names:
            values = np.array(table.column(name).chunk(0).values.to_numpy(zero_copy_only=True))
            touched += values.nbytes
    return touched


def cache_read(data: DraftData) -> int:
    tokens = 0
    for batch in data.train_dataloader():
        tokens += int((batch["doc_ids"] > 0).sum())
    return tokens


def bytes_per_token(hidden: int, n_layers: int, topk: int) -> int:
    # float16 features + (int32 id, float16 log-prob) per teacher token + int32 ids/positions/docs + int8 mask
    return 2 * hidden * n_layers + 6 * topk + 4 * 3 + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modules", type=int, default=40, help="held-out modules to cache")
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: checks that the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.modules = 1, 2
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for m in list_modules("heldout")[: args.modules]:
            (src / f"{m.name}.py").write_bytes(m.path.read_bytes())
        spec = DataSpec(paths=[str(src)], format="text", tokenizer=TARGET, max_length=512, validation_fraction=0.1)
        out = Path(tmp) / "cache"
        start = time.perf_counter()
        cache_features(TARGET, LAYERS, str(out), spec, topk=TOPK, shard_rows=32, batch_size=8)
        cache_s = time.perf_counter() - start
        cache = FeatureCache(out)
        tokens = sum(cache.manifest["tokens"].values())
        size = sum(p.stat().st_size for p in out.rglob("*.arrow"))

        data = DraftData(spec, batch_size=8, features="offline", cache_dir=str(out))
        n_train_tokens = cache_read(data)
        t_ours = best_of(lambda: cache_read(data), args.repeats)
        t_raw = best_of(lambda: raw_arrow_read(out), args.repeats)

        online = DraftData(spec, batch_size=8, features="online")
        batches = list(online.val_dataloader()) + list(online.train_dataloader())[:4]
        target = Target.from_pretrained(TARGET, LAYERS)
        bare = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()

        def run_online() -> None:
            for b in batches:
                online_features(target, b, TOPK)

        @torch.no_grad()
        def run_bare() -> None:
            for b in batches:
                bare(input_ids=b["input_ids"])

        t_online = best_of(run_online, args.repeats)
        t_bare = best_of(run_bare, args.repeats)

    cfg = target.config
    print(
        f"cache: {tokens} tokens, {size / 1e6:.1f} MB, {size / tokens:.0f} bytes/token on disk "
        f"(formula {bytes_per_token(cfg.hidden_size, len(LAYERS), TOPK)}), written in {cache_s:.1f} s"
    )
    print(
        f"offline read: {n_train_tokens / t_ours:,.0f} tokens/s through DraftData batches vs "
        f"{n_train_tokens / t_raw:,.0f} tokens/s raw Arrow -> ratio ours/raw time {t_ours / t_raw:.2f}"
    )
    print(f"online features: {t_online / t_bare:.2f}x the time of a bare target forward on the same batches")
    for name, layers in (("DFlash/TreeFlash, 5 layers", 5), ("EAGLE-3, 3 layers", 3)):
        per_token = bytes_per_token(4096, layers, TOPK)
        print(f"Qwen3-8B {name}: {per_token:,} bytes/token, {per_token * 4096 / 2**20:,.0f} MiB per 4k-token sequence")


if __name__ == "__main__":
    main()
