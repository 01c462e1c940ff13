"""Pretraining of the embedded tiny target: a transformers ``Qwen3ForCausalLM`` on the stdlib corpus.

The recipe ``recipes/target_tiny.yaml`` wires these two classes; a 20-step smoke run on CPU::

    trainer fit --recipe target_tiny --trainer.max_steps 20 --data.max_files 40

At the end of ``fit`` the model and its tokenizer are written as an HF directory (``<run>/hf`` unless
``export_dir`` says otherwise) that ``AutoModelForCausalLM.from_pretrained`` loads offline.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import sys
from pathlib import Path
from typing import Literal

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

from trainer.errors import UserError
from trainer.io import atomic_path, write_dir_atomic
from trainer.optim import adamw_warmup_cosine, muon_warmup_cosine
from trainer.paths import project_path
from trainer.tiny.corpus import Split, list_modules, package_root, read_module


class TokenChunks(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens over one token stream (inputs and shifted labels)."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.n = (len(tokens) - 1) // seq_len
        if self.n == 0:
            raise ValueError(f"token stream of {len(tokens)} tokens is shorter than one window of {seq_len + 1}")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))


class StdlibCorpus(L.LightningDataModule):
    """The stdlib source, tokenized once per (tokenizer, interpreter, slice) and cached as uint16 arrays.

    Modules are concatenated in name order, each followed by the end-of-text token, then cut into windows. With
    ``packages``, the source of those installed packages replaces the stdlib (each split by the same hash of the
    module name): the new domain of a target fine-tuned away from the stdlib (``recipes/target_tiny_moved.yaml``).

    Args:
        tokenizer: HF tokenizer directory (the tiny target's own).
        seq_len: training context length in tokens.
        batch_size: windows per optimiser step.
        max_files: take only the first ``max_files`` modules of each split (a small slice for smoke runs).
        cache_dir: where token arrays are cached.
        num_workers: DataLoader workers.
        packages: installed packages whose own Python source is the corpus instead of the standard library, in
            this order (``max_files`` applies to each).
    """

    def __init__(
        self,
        tokenizer: str = "checkpoints/target_tiny",
        seq_len: int = 512,
        batch_size: int = 16,
        max_files: int | None = None,
        cache_dir: str = "data/cache",
        num_workers: int = 0,
        packages: list[str] | None = None,
    ) -> None:
        super().__init__()
        if packages is not None and not packages:
            raise UserError("data.packages is empty: name at least one installed package, or leave it out (stdlib)")
        for package in packages or ():
            package_root(package)  # refuses a name that is not installed before anything is tokenized
        self.packages = packages
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.max_files = max_files
        self.cache_dir = Path(cache_dir)
        self.num_workers = num_workers
        self.tokenizer_path = project_path(tokenizer)
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.splits: dict[str, np.ndarray] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is not None:
            return
        if not (self.tokenizer_path / "tokenizer.json").is_file():
            raise UserError(
                f"no tokenizer at '{self.tokenizer_path}' (data.tokenizer); build it with: "
                f"python -m trainer.tiny.tokenizer --out {self.tokenizer_path}"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        if len(self.tokenizer) > np.iinfo(np.uint16).max:
            raise UserError(f"tokenizer {self.tokenizer_path} has {len(self.tokenizer)} tokens; the cache holds 65535")

    def _cache_path(self, split: Split) -> Path:
        tok_hash = hashlib.sha1(Path(self.tokenizer_path, "tokenizer.json").read_bytes()).hexdigest()[:12]
        limit = "all" if self.max_files is None else f"first{self.max_files}"
        if self.packages:
            # A package's source changes with its release: the cache is per installed version.
            source = "+".join(f"{p}{_installed_version(p)}" for p in self.packages)
            return self.cache_dir / f"{source}-{split}-{limit}-{tok_hash}.npy"
        py = "py" + ".".join(map(str, sys.version_info[:3]))
        return self.cache_dir / f"stdlib-{split}-{py}-{limit}-{tok_hash}.npy"

    def tokens(self, split: Split) -> np.ndarray:
        """The split's token stream, from the cache or tokenized now (then cached atomically)."""
        if split in self.splits:
            return self.splits[split]
        self.setup()
        path = self._cache_path(split)
        if path.exists():
            arr = np.load(path, mmap_mode="r")
        else:
            if self.packages:
                modules = [m for p in self.packages for m in list_modules(split, package_root(p), p)[: self.max_files]]
            else:
                modules = list_modules(split)[: self.max_files]
            texts = [t for t in map(read_module, modules) if t]
            eos = self.tokenizer.eos_token_id
            # Whole modules, cut into rows later: longer than model_max_length is expected (verbose=False).
            ids = self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
            arr = np.fromiter((tok for doc in ids for tok in (*doc, eos)), dtype=np.uint16)
            with atomic_path(path) as tmp, open(tmp, "wb") as f:
                np.save(f, arr)
        self.splits[split] = arr
        return arr

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            TokenChunks(self.tokens("train"), self.seq_len),
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            TokenChunks(self.tokens("validation"), self.seq_len),
            batch_size=self.batch_size,
            num_workers=self.num_workers,
        )


def _installed_version(package: str) -> str:
    """The installed release of the distribution that provides import name ``package``."""
    dists = importlib.metadata.packages_distributions().get(package)
    if not dists:
        raise UserError(f"no installed distribution provides the package '{package}' (data.packages)")
    return importlib.metadata.version(dists[0])


class TargetPretraining(L.LightningModule):
    """Next-token pretraining of a ``Qwen3ForCausalLM`` whose vocabulary is the datamodule's tokenizer.

    Args:
        hidden_size: model width.
        num_hidden_layers: decoder layers (at least 8, so that drafter layer selection is meaningful).
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention).
        head_dim: per-head width.
        intermediate_size: SwiGLU width.
        max_position_embeddings: longest context the exported config advertises.
        rope_theta: RoPE base.
        optimizer: ``muon`` (Muon on the hidden matrices, AdamW on embeddings and norms) or ``adamw``.
        lr: peak AdamW learning rate (embeddings and norms under ``muon``).
        muon_lr: peak AdamW-equivalent learning rate of the Muon matrices.
        weight_decay: decoupled weight decay on matrices, Muon's and AdamW's alike (not on norms).
        warmup_steps: linear warm-up steps.
        min_lr_ratio: cosine decay floor as a fraction of ``lr``.
        compile: ``torch.compile`` the model in place (pays off on runs longer than a few minutes).
        export_dir: HF directory written at the end of ``fit``; default ``<run log dir>/hf``.
        export_dtype: dtype of the exported weights.
        init_from: continue from the weights of this HF directory (e.g. the shipped target) instead of a
            random init; its architecture replaces the size arguments above.
    """

    def __init__(
        self,
        hidden_size: int = 256,
        num_hidden_layers: int = 8,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        head_dim: int = 64,
        intermediate_size: int = 768,
        max_position_embeddings: int = 2048,
        rope_theta: float = 10000.0,
        optimizer: Literal["muon", "adamw"] = "muon",
        lr: float = 3e-3,
        muon_lr: float = 0.02,
        weight_decay: float = 0.1,
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        compile: bool = False,
        export_dir: str | None = None,
        export_dtype: Literal["float32", "bfloat16"] = "bfloat16",
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Qwen3ForCausalLM | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        tokenizer = self._tokenizer()
        hp = self.hparams
        config = Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=hp.hidden_size,
            num_hidden_layers=hp.num_hidden_layers,
            num_attention_heads=hp.num_attention_heads,
            num_key_value_heads=hp.num_key_value_heads,
            head_dim=hp.head_dim,
            intermediate_size=hp.intermediate_size,
            max_position_embeddings=hp.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": hp.rope_theta},
            tie_word_embeddings=True,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            attn_implementation="sdpa",
        )
        if hp.init_from:
            self.model = Qwen3ForCausalLM.from_pretrained(str(project_path(hp.init_from)), dtype=torch.float32)
            if self.model.config.vocab_size != len(tokenizer):
                raise UserError(
                    f"model.init_from {hp.init_from} has a vocabulary of {self.model.config.vocab_size}, "
                    f"the tokenizer {len(tokenizer)}"
                )
        else:
            self.model = Qwen3ForCausalLM(config)
        if hp.compile:
            self.model.compile()

    def _tokenizer(self) -> PreTrainedTokenizerBase:
        datamodule = self.trainer.datamodule
        if not isinstance(datamodule, StdlibCorpus):
            raise TypeError("TargetPretraining takes its vocabulary from a StdlibCorpus datamodule")
        return datamodule.tokenizer

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        # Shape: batch (B, T + 1) → inputs (B, T), labels (B, T)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = self.model(input_ids=inputs).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/tokens", float(batch[:, 1:].numel()), reduce_fx="sum", on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        hp = self.hparams
        if hp.optimizer == "muon":
            return muon_warmup_cosine(
                self.model,
                hp.muon_lr,
                hp.lr,
                hp.weight_decay,
                hp.warmup_steps,
                self.trainer.estimated_stepping_batches,
                hp.min_lr_ratio,
            )
        return adamw_warmup_cosine(
            self.model.parameters(),
            hp.lr,
            hp.weight_decay,
            hp.warmup_steps,
            self.trainer.estimated_stepping_batches,
            hp.min_lr_ratio,
            betas=(0.9, 0.95),
        )

    def on_fit_end(self) -> None:
        if self.trainer.is_global_zero:
            out = Path(self.hparams.export_dir or Path(self.trainer.log_dir or ".") / "hf")
            export_hf(self.model, self._tokenizer(), out, getattr(torch, self.hparams.export_dtype))


def export_hf(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerBase, out: Path, dtype: torch.dtype) -> None:
    """Write model (in ``dtype``) and tokenizer as an HF directory; a crash never leaves a half-written ``out``."""
    original_dtype = next(model.parameters()).dtype

    def save(tmp: Path) -> None:
        model.to(dtype)
        try:
            model.save_pretrained(tmp)
        finally:
            model.to(original_dtype)
        tokenizer.save_pretrained(tmp)

    write_dir_atomic(out, save)
