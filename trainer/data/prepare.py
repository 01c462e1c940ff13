"""From a data spec to packed training rows.

``DataSpec`` is shared by training recipes (``data.init_args.spec``) and by ``trainer data cache``, so a cache
is built from exactly the rows training would see; ``trainer.training.datamodule.DraftData`` serves the rows
to a drafter.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from trainer.data.pack import PackedRow, pack, truncate
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
        tokenizer: tokenizer directory or hub id; its own chat template renders the conversations. Unset, the
            target's (``trainer fit`` and ``trainer data cache`` fill it in); another tokenizer than the
            target's is an error (see ``data_tokenizer``).
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
    tokenizer: str | None = None
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


def data_tokenizer(tokenizer: str | None, target: str) -> str:
    """The tokenizer of a drafter's data: the target's when ``tokenizer`` is unset, else ``tokenizer`` if it is
    the target's (same vocabulary and chat template). A drafter trained on another tokenizer's ids learns
    tokens the target never emits, so a different one is an error naming both."""
    if tokenizer is None:
        return target
    if tokenizer == target or project_path(tokenizer).resolve() == project_path(target).resolve():
        return tokenizer
    ours, targets = load_tokenizer(tokenizer), load_tokenizer(target)
    differ = [
        what
        for what, a, b in (
            ("vocabulary", ours.get_vocab(), targets.get_vocab()),
            ("chat template", ours.chat_template, targets.chat_template),
        )
        if a != b
    ]
    if differ:
        raise UserError(
            f"the data tokenizer '{tokenizer}' is not the tokenizer of the target '{target}' "
            f"({' and '.join(differ)} differ); leave data.spec.tokenizer out to use the target's"
        )
    return tokenizer


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
