"""From a data spec to packed training rows, and the DataModule that serves them to a drafter.

``DataSpec`` is shared by training recipes (``data.init_args.spec``) and by ``trainer data cache``, so a cache
is built from exactly the rows training would see. ``DraftData`` serves either token batches (``features:
online``; the LightningModule runs the frozen target inside its step, ``trainer.data.features``) or batches
read from a feature cache (``features: offline``); a drafter gets the same batch either way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from trainer.data.pack import PackedRow, collate, pack, truncate
from trainer.data.render import Rendered, render_chat, render_text
from trainer.data.sources import LoadReport, load_chat, load_hub, load_text, split_train_validation
from trainer.errors import UserError
from trainer.paths import project_path


@dataclass
class DataSpec:
    """Where the data is and how it becomes rows.

    Args:
        paths: local files or directories (chat: JSON/JSONL/Parquet; text: code or prose files); a hub
            dataset as ``hub:NAME`` where a hub is reachable.
        format: ``chat`` (OpenAI ``messages`` or ShareGPT ``conversations``; loss on assistant tokens only) or
            ``text`` (every token).
        tokenizer: tokenizer directory or hub id; its own chat template renders the conversations.
        max_length: tokens per row.
        packing: pack several samples into one row (no attention across them).
        truncation: cut samples longer than ``max_length``; if false they are dropped and counted.
        validation_fraction: share of samples held out for validation (deterministic by ``seed``).
        seed: shuffle seed.
        strict: fail on the first malformed row instead of skipping and reporting it.
        chat_template_kwargs: extra template variables, e.g. ``{enable_thinking: false}`` for Qwen3.
    """

    paths: list[str]
    format: Literal["chat", "text"] = "chat"
    tokenizer: str = "checkpoints/target_tiny"
    max_length: int = 1024
    packing: bool = True
    truncation: bool = True
    validation_fraction: float = 0.05
    seed: int = 0
    strict: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Prepared:
    train: list[PackedRow]
    validation: list[PackedRow]
    report: LoadReport
    dropped_too_long: int


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    path = project_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load tokenizer '{name_or_path}': {e}") from None


def _chunks(sample: Rendered, max_length: int) -> list[Rendered]:
    """A long text document as consecutive ``max_length`` pieces (every token of a file gets trained on)."""
    return [
        Rendered(sample.input_ids[i : i + max_length], sample.loss_mask[i : i + max_length], sample.text)
        for i in range(0, len(sample.input_ids), max_length)
    ]


def _render_all(spec: DataSpec, tokenizer: PreTrainedTokenizerBase, rows: Any) -> tuple[list[Rendered], int]:
    out, dropped = [], 0
    for row in rows:
        if spec.format == "text":
            # Text has no turn structure to respect: long files are cut into rows rather than truncated.
            out += _chunks(render_text(tokenizer, row["text"]), spec.max_length)
            continue
        sample = render_chat(tokenizer, row["messages"], **spec.chat_template_kwargs)
        if len(sample.input_ids) > spec.max_length:
            if not spec.truncation:
                dropped += 1
                continue
            sample = truncate(sample, spec.max_length)
        out.append(sample)
    return out, dropped


def prepare(spec: DataSpec, tokenizer: PreTrainedTokenizerBase | None = None) -> Prepared:
    """Load, split, render and pack. Deterministic for a given spec; fails on an empty result."""
    tokenizer = tokenizer or load_tokenizer(spec.tokenizer)
    report = LoadReport()
    if spec.format == "text":
        ds = load_text(spec.paths)
    elif len(spec.paths) == 1 and spec.paths[0].startswith("hub:"):
        ds = load_hub(spec.paths[0][4:], strict=spec.strict)
    else:
        ds = load_chat(spec.paths, strict=spec.strict, report=report)
    train_ds, val_ds = split_train_validation(ds, spec.validation_fraction, spec.seed)
    train_samples, dropped_t = _render_all(spec, tokenizer, train_ds)
    val_samples, dropped_v = _render_all(spec, tokenizer, val_ds)
    train = pack(train_samples, spec.max_length, spec.packing)
    validation = pack(val_samples, spec.max_length, spec.packing)
    if not train:
        raise UserError(
            f"no training rows from {spec.paths}: every sample was empty, too long or had no loss tokens "
            f"({dropped_t} dropped as longer than max_length {spec.max_length}); {report.summary()}"
        )
    if not validation:
        raise UserError(f"no validation rows from {spec.paths}; raise validation_fraction")
    random.Random(spec.seed).shuffle(train)
    return Prepared(train, validation, report, dropped_t + dropped_v)


class RowDataset(Dataset):
    def __init__(self, rows: list[PackedRow]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return vars(self.rows[i])


class ResumableSampler(Sampler[int]):
    """A seeded permutation per epoch that can start after the first ``skip`` indices (resume mid-epoch)."""

    def __init__(self, n: int, seed: int, epoch: int = 0, skip: int = 0) -> None:
        self.n, self.seed, self.epoch, self.skip = n, seed, epoch, skip

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + self.epoch))
        yield from order[self.skip :].tolist()

    def __len__(self) -> int:
        # The full epoch: after a resume Lightning counts the batches already taken (restored from the
        # checkpoint) towards it, and ends the epoch when this many have been taken in all.
        return self.n


class DraftData(L.LightningDataModule):
    """Batches for drafter training: ``input_ids``, ``loss_mask``, ``position_ids``, ``doc_ids`` (B, T), plus
    ``features`` and the teacher's top-k in offline mode.

    Args:
        spec: the data (see ``DataSpec``).
        batch_size: rows per step.
        features: ``online`` runs the target in the training step; ``offline`` reads ``cache_dir``.
        cache_dir: output directory of ``trainer data cache`` (offline mode).
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        spec: DataSpec,
        batch_size: int = 4,
        features: Literal["online", "offline"] = "online",
        cache_dir: str | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.batch_size = batch_size
        self.features = features
        self.cache_dir = cache_dir
        self.num_workers = num_workers
        if features == "offline" and not cache_dir:
            raise UserError("data.features is 'offline' but data.cache_dir is not set")
        self.tokenizer = load_tokenizer(spec.tokenizer)
        self._datasets: dict[str, Dataset] = {}
        self._resume: dict[str, int] | None = None
        self.feature_cache = None

    def setup(self, stage: str | None = None) -> None:
        if self._datasets:
            return
        if self.features == "offline":
            from trainer.data.cache import FeatureCache

            self.feature_cache = FeatureCache(Path(self.cache_dir), expect_spec=self.spec)
            self._datasets = {s: self.feature_cache.split(s) for s in ("train", "validation")}
        else:
            prepared = prepare(self.spec, self.tokenizer)
            if prepared.report.malformed or prepared.dropped_too_long:
                print(
                    f"data: {prepared.report.summary()}; {prepared.dropped_too_long} samples longer than "
                    f"max_length {self.spec.max_length} dropped (truncation: false)"
                )
            self._datasets = {"train": RowDataset(prepared.train), "validation": RowDataset(prepared.validation)}

    def _loader(self, split: str, sampler: Sampler[int] | None = None) -> DataLoader:
        self.setup()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return DataLoader(
            self._datasets[split],
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=sampler is not None,
            num_workers=self.num_workers,
            collate_fn=partial(collate_features, pad_id=pad),
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled by (seed, epoch); after a resume it starts at the batch the checkpoint had reached."""
        self.setup()
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        skip_batches = 0
        if self._resume is not None and self._resume["epoch"] == epoch:
            skip_batches = self._resume["batches"]
        self._resume = None
        n = len(self._datasets["train"])
        skip = min(n, skip_batches * self.batch_size)
        return self._loader("train", ResumableSampler(n, self.spec.seed, epoch, skip))

    def state_dict(self) -> dict[str, int]:
        """Saved in every checkpoint: the epoch and how many of its batches the run had taken."""
        if self.trainer is None:
            return {}
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
        return {"epoch": self.trainer.current_epoch, "batches": progress.ready}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._resume = dict(state_dict) if state_dict else None

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation")


def collate_features(rows: list[dict], pad_id: int) -> dict:
    """``collate`` plus right-padded ``features`` / teacher top-k when the rows carry them (offline)."""
    batch = collate(rows, pad_id)
    if "features" in rows[0]:
        width = batch["input_ids"].shape[1]
        for key in ("features", "teacher_topk_ids", "teacher_topk_logprobs"):
            first = rows[0][key]
            out = torch.zeros((len(rows), width, first.shape[-1]), dtype=first.dtype)
            for i, r in enumerate(rows):
                out[i, : r[key].shape[0]] = r[key]
            batch[key] = out.long() if key == "teacher_topk_ids" else out
    return batch
