"""The DataModule that serves prepared rows (``trainer.data.prepare``) or a feature cache to a drafter.

``DraftData`` serves either token batches (``features: online``; the LightningModule runs the frozen target
inside its step, ``trainer.data.features``) or batches read from a feature cache (``features: offline``,
``trainer.data.cache``); a drafter gets the same batch either way. Its order is a seeded permutation per epoch,
split across the ranks, and a resumed run starts at the sample its checkpoint had reached, on any number of ranks.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from trainer.data.cache import FeatureCache
from trainer.data.pack import PackedRow, collate_features
from trainer.data.prepare import DataSpec, load_tokenizer, prepare
from trainer.errors import UserError


class RowDataset(Dataset):
    def __init__(self, rows: list[PackedRow]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return vars(self.rows[i])


class ResumableSampler(DistributedSampler):
    """A seeded permutation per epoch that can start after its first ``skip`` indices (resume mid-epoch), split
    across ``world_size`` ranks so that the ranks together take the order in single-process steps.

    Global batch ``g`` is ``order[skip + g·W·B :]``'s next ``W·B`` indices; rank ``r`` takes the ``r``-th ``B`` of
    them. So a run on ``W`` ranks with batch ``B`` sees, step by step, what one process with batch ``B`` and
    ``W``-step gradient accumulation sees; indices that would leave the ranks unequal are dropped. It subclasses
    ``DistributedSampler`` only so that Lightning does not wrap it in a second, reshuffling one.
    """

    def __init__(
        self, n: int, seed: int, epoch: int = 0, skip: int = 0, rank: int = 0, world_size: int = 1, batch_size: int = 1
    ) -> None:
        self.n, self.seed, self.epoch, self.skip = n, seed, epoch, skip
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + self.epoch))
        per_step = self.world_size * self.batch_size
        rest = order[self.skip :]
        rest = rest[: len(rest) // per_step * per_step].view(-1, self.world_size, self.batch_size)
        yield from rest[:, self.rank].flatten().tolist()

    def __len__(self) -> int:
        # This rank's share of the full epoch: after a resume Lightning counts the batches already taken (restored
        # from the checkpoint) towards it, and ends the epoch when this many have been taken in all.
        return self.n // (self.world_size * self.batch_size) * self.batch_size


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
        """Shuffled by (seed, epoch); after a resume it starts at the sample the checkpoint had reached, whatever
        the number of ranks then and now (Lightning splits what remains of the order across the ranks)."""
        self.setup()
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        n = len(self._datasets["train"])
        skip = 0
        if self._resume is not None and self._resume["epoch"] == epoch:
            skip = min(n, self._resume["samples"])
            if self._resume["world_size"] != self.trainer.world_size:
                self._rescale_progress(skip)
        self._resume = None
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        sampler = ResumableSampler(n, self.spec.seed, epoch, skip, rank, world, self.batch_size)
        return self._loader("train", sampler)

    def _rescale_progress(self, samples: int) -> None:
        # Lightning restored the old run's per-rank batch count, in units of the old world size; the epoch ends
        # when that count reaches the per-rank length, so it must count the batches this world size has taken.
        # A save in on_train_batch_end records one batch fewer completed than ready; that offset stays.
        taken = samples // (self.batch_size * self.trainer.world_size)
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
        pending = progress.ready - progress.completed
        progress.ready = progress.started = progress.processed = taken
        progress.completed = taken - pending

    def state_dict(self) -> dict[str, int]:
        """Saved in every checkpoint: the epoch, and how many of its samples all ranks together had taken."""
        if self.trainer is None:
            return {}
        batches = self.trainer.fit_loop.epoch_loop.batch_progress.current.ready
        world = self.trainer.world_size
        return {"epoch": self.trainer.current_epoch, "samples": batches * self.batch_size * world, "world_size": world}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        if state_dict and "samples" not in state_dict:
            # A checkpoint from before world-size-aware resume: one rank, counted in batches.
            state_dict = {**state_dict, "samples": state_dict["batches"] * self.batch_size, "world_size": 1}
        self._resume = dict(state_dict) if state_dict else None

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation")
