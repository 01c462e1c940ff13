"""Offline target features: ``trainer data cache`` writes them once, training reads them memory-mapped.

Layout of a cache directory::

    manifest.json                  what was cached (target, layers, top-k, the DataSpec, row counts)
    train/shard-00000.arrow ...    Arrow IPC files, one record batch each
    validation/shard-00000.arrow
    draft_vocab.safetensors        d2t / t2d of the reduced draft vocabulary (trainer.drafters.vocab)

A row holds ``input_ids``, ``loss_mask``, ``position_ids``, ``doc_ids``, ``features`` (T·n·H float16, the
target layers' hidden states), ``teacher_topk_ids`` (T·k int32) and ``teacher_topk_logprobs`` (T·k float16).
Shards are written to a temporary name and renamed, so a kill at any moment leaves only whole shards; a
rerun with the same arguments skips them. Reading maps the files and hands out float16 tensors that are
views of the mapped pages: no copy, no upcast. On CPU with the tiny target::

    trainer data cache --target checkpoints/target_tiny --layers '[1, 4, 7]' --out data/cache/feat \\
        --spec.paths '[data/chats.jsonl]' --spec.max_length 256
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, replace
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import torch
from rich.progress import Progress
from torch.utils.data import Dataset

from trainer.data.features import online_features
from trainer.data.pack import PackedRow, collate, loss_token_counts
from trainer.data.prepare import DataSpec, data_tokenizer, load_tokenizer, prepare
from trainer.data.vllm_engine import VllmFeatures, handed_over
from trainer.drafters.vocab import DraftVocab
from trainer.errors import UserError
from trainer.io import atomic_path, write_text_atomic
from trainer.target import Target

FORMAT_VERSION = 1
SPLITS = ("train", "validation")
# Cache rows are views of read-only mapped pages, never written; torch's warning about that is noise here.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
COLUMNS = {
    "input_ids": pa.int32(),
    "loss_mask": pa.int8(),
    "position_ids": pa.int32(),
    "doc_ids": pa.int32(),
    "features": pa.float16(),
    "teacher_topk_ids": pa.int32(),
    "teacher_topk_logprobs": pa.float16(),
}
SCHEMA = pa.schema([(name, pa.list_(t)) for name, t in COLUMNS.items()])


def _shard_path(out: Path, split: str, index: int) -> Path:
    return out / split / f"shard-{index:05d}.arrow"


def _list_array(chunks: list[np.ndarray], arrow_type: pa.DataType) -> pa.ListArray:
    offsets = np.zeros(len(chunks) + 1, dtype=np.int32)
    offsets[1:] = np.cumsum([len(c) for c in chunks])
    values = pa.array(np.concatenate(chunks), type=arrow_type)
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def _write_shard(path: Path, columns: dict[str, list[np.ndarray]]) -> None:
    batch = pa.RecordBatch.from_arrays([_list_array(columns[n], t) for n, t in COLUMNS.items()], schema=SCHEMA)
    with atomic_path(path) as tmp, pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
        writer.write_batch(batch)


def _manifest_config(target: str, layers: list[int], topk: int, spec: DataSpec, shard_rows: int) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "target": target,
        "layers": list(layers),
        "topk": topk,
        "shard_rows": shard_rows,
        "feature_dtype": "float16",
        "spec": asdict(spec),
    }


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
        manifest["config"]["format_version"], manifest["complete"], manifest["rows"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path} is not a feature-cache manifest ({type(e).__name__}: {e}); delete the cache") from None
    return manifest


def cache_features(
    target: str,
    layers: list[int],
    out: str,
    spec: DataSpec,
    topk: int = 32,
    shard_rows: int = 64,
    batch_size: int = 4,
    dtype: str = "float32",
    draft_vocab_size: int | None = None,
    engine: Literal["hf", "vllm"] = "hf",
    vllm_python: str | None = None,
) -> None:
    """Run the target over the prepared rows of ``spec`` and write features and teacher top-k to ``out``.

    Args:
        target: HF causal LM directory or hub id.
        layers: target layer ids whose outputs form the feature (HF hidden_states[l + 1]).
        out: cache directory; an existing cache of the same arguments is resumed, a different one refused.
        spec: the data, exactly as the training recipe states it (its tokenizer defaults to the target's).
        topk: teacher tokens kept per position.
        shard_rows: rows per shard file (the unit of resume).
        batch_size: rows per target forward (engine hf; vLLM runs one document per forward).
        dtype: target compute dtype; features are stored as float16 whatever it is.
        draft_vocab_size: also write d2t/t2d for a reduced draft vocabulary of this size.
        engine: what runs the target: hf (transformers in this process) or vllm (vLLM's offline engine: in this
            process when vLLM is importable here, else in vLLM's environment, see vllm_python); the same cache
            either way, within float32 rounding.
        vllm_python: engine vllm only: the python of vLLM's environment, used when vLLM is not importable here;
            default $TRAINER_VLLM_PYTHON.
    """
    arguments = dict(target=target, layers=list(layers), out=out, spec=asdict(spec), topk=topk,
                     shard_rows=shard_rows, batch_size=batch_size, dtype=dtype, draft_vocab_size=draft_vocab_size)
    if handed_over("cache", engine, arguments, vllm_python):
        return
    out_dir = Path(out)
    spec = replace(spec, tokenizer=data_tokenizer(spec.tokenizer, target))
    config = _manifest_config(target, layers, topk, spec, shard_rows)
    manifest_path = out_dir / "manifest.json"
    old = None
    if manifest_path.exists():
        old = _read_manifest(manifest_path)
        if old["config"] != config:
            diff = sorted(k for k in config if old["config"].get(k) != config[k])
            raise UserError(
                f"{out_dir} holds a cache made with other arguments (differs in {diff}); "
                "choose another --out or delete it"
            )
    tokenizer = load_tokenizer(spec.tokenizer)
    prepared = prepare(spec, tokenizer)
    rows = {"train": prepared.train, "validation": prepared.validation}
    manifest = {
        "config": config,
        "rows": {s: len(r) for s, r in rows.items()},
        "tokens": {s: sum(len(r.input_ids) for r in rs) for s, rs in rows.items()},
        "shard_rows": shard_rows,
        # Which engines wrote shards (a resume may use another one); a cache from before the field: the HF engine.
        "engines": sorted({*(old.get("engines", ["hf"]) if old else []), engine}),
        "complete": False,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(manifest_path, json.dumps(manifest, indent=1))
    if draft_vocab_size:
        counts = loss_token_counts(map(vars, prepared.train), len(tokenizer))
        DraftVocab.from_counts(counts, draft_vocab_size).save(out_dir / "draft_vocab.safetensors")

    if engine == "vllm":
        vllm = VllmFeatures(target, layers, topk, dtype, spec.max_length)

        def compute(chunk: list[PackedRow]) -> dict:
            return _compute_vllm(vllm, chunk)
    else:
        model = Target.from_pretrained(target, layers, dtype=dtype)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

        def compute(chunk: list[PackedRow]) -> dict:
            return _compute(model, chunk, topk, batch_size, pad)

    total = sum(len(r) for r in rows.values())
    with Progress() as progress:
        task = progress.add_task("caching features", total=total)
        for split, split_rows in rows.items():
            for shard in range(math.ceil(len(split_rows) / shard_rows)):
                chunk = split_rows[shard * shard_rows : (shard + 1) * shard_rows]
                path = _shard_path(out_dir, split, shard)
                if not path.exists():
                    _write_shard(path, compute(chunk))
                progress.advance(task, len(chunk))
    manifest["complete"] = True
    write_text_atomic(manifest_path, json.dumps(manifest, indent=1))
    size = sum(p.stat().st_size for p in out_dir.rglob("*.arrow"))
    tokens = sum(manifest["tokens"].values())
    print(f"cached {total} rows, {tokens} tokens, {size / tokens:.0f} bytes/token -> {out_dir} (engine {engine})")


def _append(columns: dict[str, list[np.ndarray]], row: dict, feats: dict[str, torch.Tensor]) -> None:
    """One row's columns in their stored dtypes; ``feats``: the row's (T, ...) features and teacher top-k."""
    for key in ("input_ids", "loss_mask", "position_ids", "doc_ids"):
        columns[key].append(np.asarray(row[key], dtype=COLUMNS[key].to_pandas_dtype()))
    columns["features"].append(feats["features"].to(torch.float16).flatten().numpy())
    columns["teacher_topk_ids"].append(feats["teacher_topk_ids"].to(torch.int32).flatten().numpy())
    columns["teacher_topk_logprobs"].append(feats["teacher_topk_logprobs"].to(torch.float16).flatten().numpy())


def _compute(model: Target, rows: list[PackedRow], topk: int, batch_size: int, pad: int) -> dict:
    columns: dict[str, list[np.ndarray]] = {name: [] for name in COLUMNS}
    for start in range(0, len(rows), batch_size):
        part = [vars(r) for r in rows[start : start + batch_size]]
        batch = collate(part, pad)
        feats = online_features(model, batch, topk)
        for i, row in enumerate(part):
            n = len(row["input_ids"])
            _append(columns, row, {key: value[i, :n] for key, value in feats.items()})
    return columns


def _compute_vllm(engine: VllmFeatures, rows: list[PackedRow]) -> dict:
    columns: dict[str, list[np.ndarray]] = {name: [] for name in COLUMNS}
    part = [vars(r) for r in rows]
    for row, feats in zip(part, engine(part), strict=True):
        _append(columns, row, feats)
    return columns


class CachedSplit(Dataset):
    """Rows of one split, served as views of the memory-mapped Arrow shards."""

    def __init__(self, shards: list[Path], feature_dim: int, topk: int) -> None:
        self.feature_dim = feature_dim
        self.topk = topk
        self._columns: list[dict[str, tuple[np.ndarray, np.ndarray]]] = []
        self._index: list[tuple[int, int]] = []
        for s, path in enumerate(shards):
            table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
            cols = {}
            for name in COLUMNS:
                arr = table.column(name).chunk(0)
                cols[name] = (arr.offsets.to_numpy(), arr.values.to_numpy(zero_copy_only=True))
            self._columns.append(cols)
            self._index += [(s, i) for i in range(table.num_rows)]

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> dict:
        shard, row = self._index[i]
        cols = self._columns[shard]
        out: dict = {}
        for name, (offsets, values) in cols.items():
            view = torch.from_numpy(values[offsets[row] : offsets[row + 1]])
            if name == "features":
                view = view.view(-1, self.feature_dim)
            elif name.startswith("teacher"):
                view = view.view(-1, self.topk)
            out[name] = view
        return out


class FeatureCache:
    """A finished cache directory; ``expect_spec`` refuses a cache made from other data."""

    def __init__(self, root: Path, expect_spec: DataSpec | None = None) -> None:
        self.root = root
        path = root / "manifest.json"
        if not path.is_file():
            raise UserError(f"no feature cache at {root} (missing manifest.json); build it with trainer data cache")
        self.manifest = _read_manifest(path)
        config = self.manifest["config"]
        if config["format_version"] != FORMAT_VERSION:
            raise UserError(f"feature cache {root} has format {config['format_version']}, expected {FORMAT_VERSION}")
        if not self.manifest["complete"]:
            raise UserError(f"feature cache {root} is incomplete (the cache job was interrupted); rerun it to finish")
        if expect_spec is not None and config["spec"] != asdict(expect_spec):
            diff = sorted(k for k, v in asdict(expect_spec).items() if config["spec"].get(k) != v)
            raise UserError(f"feature cache {root} was built from other data (spec differs in {diff})")
        self.topk = config["topk"]

    def split(self, name: str) -> CachedSplit:
        shards = sorted((self.root / name).glob("shard-*.arrow"))
        expected = math.ceil(self.manifest["rows"][name] / self.manifest["config"]["shard_rows"])
        if len(shards) != expected:
            raise UserError(f"feature cache {self.root}/{name} has {len(shards)} shards, manifest says {expected}")
        first = pa.ipc.open_file(pa.memory_map(str(shards[0]), "r")).read_all()
        n_tokens = len(first.column("input_ids").chunk(0)[0])
        feature_dim = len(first.column("features").chunk(0)[0]) // n_tokens
        return CachedSplit(shards, feature_dim, self.topk)
