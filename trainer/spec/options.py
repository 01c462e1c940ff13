"""Tree hyperparameters: what `trainer eval --tree-opt KEY=VALUE` and the server pass to the tree builders.

Defaults are the reference settings of each builder (docs/algorithms.md): TreeFlash's stage-one/stage-two widths
(§4), EAGLE-2's dynamic tree (§6), SpecBlock's growth (§5) and the Token-Recycling template (§8). Budgets
are not here: every builder takes its node budget per step, so a controller can change it between steps.

    python -c "from trainer.spec.options import TreeOptions; print(TreeOptions.parse(['eagle_top_k=8']))"
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass

from trainer.errors import UserError


@dataclass(frozen=True)
class TreeOptions:
    # TreeFlash stage one: candidates per slot; None = the checkpoint's `treeflash_config.candidate_tokens`.
    treeflash_top_m: int | None = None
    # TreeFlash stage two: corrected continuations kept per (slot, candidate previous token).
    treeflash_top_k: int = 16
    # EAGLE-2: children recorded per expanded node, and the beam of frontier nodes expanded per depth.
    eagle_top_k: int = 10
    # EAGLE-2: drafter forwards per step (tree depth), the context forward included.
    eagle_depth: int = 7
    # SpecBlock: children added at a slot per rank class 0..3 (class 3: rank > 10).
    specblock_branch: tuple[int, ...] = (1, 4, 10, 0)
    # SpecBlock: block rounds per step (the root block's included) and blocks launched per round.
    specblock_rounds: int = 3
    specblock_blocks_per_round: int = 8
    # Token Recycling: successors kept per adjacency row, the template's per-rank decay and its depth.
    recycling_width: int = 8
    recycling_decay: float = 0.5
    recycling_max_depth: int = 6

    def __post_init__(self) -> None:
        positive = ("treeflash_top_k", "eagle_top_k", "eagle_depth", "specblock_rounds", "specblock_blocks_per_round",
                    "recycling_width", "recycling_max_depth")  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise UserError(f"tree option {name} must be at least 1, got {getattr(self, name)}")
        if self.treeflash_top_m is not None and self.treeflash_top_m < 1:
            raise UserError(f"tree option treeflash_top_m must be at least 1, got {self.treeflash_top_m}")
        if len(self.specblock_branch) != 4 or min(self.specblock_branch) < 0:
            raise UserError(f"tree option specblock_branch takes 4 widths >= 0, got {self.specblock_branch}")
        if not 0.0 < self.recycling_decay < 1.0:
            raise UserError(f"tree option recycling_decay must lie in (0, 1), got {self.recycling_decay}")

    @classmethod
    def parse(cls, items: list[str]) -> TreeOptions:
        """``["eagle_top_k=8", "specblock_branch=2,4,10,0"]`` → options; a bad key or value names itself."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        values: dict[str, object] = {}
        for item in items:
            key, sep, text = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in fields:
                raise UserError(f"tree option {item!r}: expected KEY=VALUE with KEY one of {sorted(fields)}")
            values[key] = _convert(key, text.strip(), hints[key])
        return cls(**values)


def _convert(key: str, text: str, hint: object) -> object:
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kind = next(k for k in typing.get_args(hint) if k is not type(None)) if optional else hint
    try:
        if typing.get_origin(kind) is tuple:
            return tuple(int(v) for v in text.split(",") if v.strip())
        if optional and text.lower() == "none":
            return None
        return kind(text)  # type: ignore[operator]
    except ValueError:
        raise UserError(f"tree option {key}={text!r}: not a valid {getattr(kind, '__name__', kind)}") from None
