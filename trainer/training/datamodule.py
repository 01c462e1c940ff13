"""The DataModule that serves prepared rows (``trainer.data.prepare``) or a feature cache to a drafter.

``DraftData`` serves either token batches (``features: online``; the LightningModule runs the frozen target
inside its step, ``trainer.data.features``) or batches read from a feature cache (``features: offline``,
``trainer.data.cache``); a drafter gets the same batch either way. Its order is a seeded permutation per epoch,
and a resumed run starts at the batch its checkpoint had reached.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trainer.data.cache import FeatureCache
from trainer.data.pack import PackedRow, collate
from trainer.data.prepare import DataSpec, load_tokenizer, prepare
from trainer.errors import UserError


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
        if spec.tokenizer is None:
            raise UserError("data.spec.tokenizer is unset: name the target's tokenizer (trainer fit fills it in)")
        self.tokenizer = load_tokenizer(spec.tokenizer)
        self._datasets: dict[str, Dataset] = {}
        self._resume: dict[str, int] | None = None
        self.feature_cache = None

    def setup(self, stage: str | None = None) -> None:
        if self._datasets:
            return
        if self.features == "offline":
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
