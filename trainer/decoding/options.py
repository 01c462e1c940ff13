"""Tree hyperparameters: what `trainer eval --tree-opt KEY=VALUE` and the server pass to the tree builders.

Defaults are the reference settings of each builder (docs/algorithms.md): TreeFlash's stage-one/stage-two
widths (§4), EAGLE-2's dynamic tree (§6), SpecBlock's growth (§5), the Token-Recycling template (§8) and
Graft's pruning and budget split (§7; ours to choose, the paper publishes neither). Budgets
are not here: every builder takes its node budget per step, so a controller can change it between steps.

    python -c "from trainer.decoding.options import TreeOptions; print(TreeOptions.parse(['eagle_top_k=8']))"
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass

from trainer.decoding.tree import CONFIDENCES
from trainer.errors import UserError

BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}

# What a SpecBlock stop (a slot of width 0) ends.
SPECBLOCK_STOPS = ("branching", "chain")


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
    # SpecBlock: children of a slot per rank class 0..3 (class 3: rank > 10), the greedy token included; a width
    # of 0 is a stop (see specblock_stop).
    specblock_branch: tuple[int, ...] = (2, 4, 10, 0)
    # SpecBlock: children of the root block's slot 0 whatever its class; None = by its class like any slot.
    specblock_root_width: int | None = 10
    # SpecBlock: what a stop (width 0) ends: "branching" (the block's greedy tokens stay, later slots add no
    # alternatives, no block continues it) or "chain" (the block's walk ends before the slot).
    specblock_stop: str = "branching"
    # SpecBlock: a greedy token at a slot that branches launches a block too (not only its alternatives).
    specblock_launch_greedy: bool = True
    # SpecBlock: block rounds per step (the root block's included), and at most this many blocks per round
    # (fewer when the budget left holds fewer blocks of K nodes).
    specblock_rounds: int = 2
    specblock_blocks_per_round: int = 10
    # Token Recycling: successors kept per adjacency row, the template's per-rank decay and its depth.
    recycling_width: int = 8
    recycling_decay: float = 0.5
    recycling_max_depth: int = 6
    # Graft (docs/algorithms.md §7): checkpoint depths d (ascending); at checkpoint d the frontier of depth d + 1 is
    # kept, and drafting goes deeper only if its confidence reaches the stage's threshold.
    # Confidence and thresholds come from `benchmarks/graft.py --sweep` on held-out prompts with the tiny
    # drafters (the paper publishes neither): the best path's probability pruned as well as any kind and, at
    # these thresholds, modelled speed was highest; rerun the sweep for another drafter.
    graft_checkpoints: tuple[int, ...] = (0, 1, 5)
    graft_thresholds: tuple[float, ...] = (0.3, 0.1, 0.02)
    # Graft: the frontier confidence, one of trainer.decoding.tree.CONFIDENCES (see frontier_confidence).
    graft_confidence: str = "best"
    # Graft: the budget share kept for drafted nodes per stage (a pruning checkpoint, then "not pruned"); the
    # rest goes to the retrieval template from the adjacency matrix, and fills whatever the draft leaves.
    graft_draft_share: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    # Graft: graft retrieval at all (false: the pruned drafter tree alone, with the whole budget).
    graft_retrieval: bool = True

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
        if self.specblock_root_width is not None and self.specblock_root_width < 1:
            raise UserError(
                f"tree option specblock_root_width must be at least 1 or none, got {self.specblock_root_width}"
            )
        if self.specblock_stop not in SPECBLOCK_STOPS:
            raise UserError(f"tree option specblock_stop must be one of {SPECBLOCK_STOPS}, got {self.specblock_stop!r}")
        if not 0.0 < self.recycling_decay < 1.0:
            raise UserError(f"tree option recycling_decay must lie in (0, 1), got {self.recycling_decay}")
        checkpoints = self.graft_checkpoints
        if not checkpoints or min(checkpoints) < 0 or list(checkpoints) != sorted(set(checkpoints)):
            raise UserError(f"tree option graft_checkpoints takes ascending depths >= 0, got {checkpoints}")
        if len(self.graft_thresholds) != len(checkpoints):
            raise UserError(
                f"tree option graft_thresholds takes one threshold per checkpoint ({len(checkpoints)}), "
                f"got {self.graft_thresholds}"
            )
        if len(self.graft_draft_share) != len(checkpoints) + 1 or not all(0 <= v <= 1 for v in self.graft_draft_share):
            raise UserError(
                f"tree option graft_draft_share takes {len(checkpoints) + 1} shares in [0, 1] (one per checkpoint, "
                f"then one for an unpruned tree), got {self.graft_draft_share}"
            )
        if self.graft_confidence not in CONFIDENCES:
            raise UserError(f"tree option graft_confidence must be one of {CONFIDENCES}, got {self.graft_confidence!r}")

    @classmethod
    def parse(cls, items: list[str]) -> TreeOptions:
        """``["eagle_top_k=8", "specblock_branch=2,4,10,0", "graft_retrieval=false"]`` → options; a bad key or
        value names itself."""
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
            item = typing.get_args(kind)[0]
            return tuple(item(v) for v in text.split(",") if v.strip())
        if optional and text.lower() == "none":
            return None
        if kind is bool:
            if text.lower() not in BOOLEANS:
                raise ValueError(text)
            return BOOLEANS[text.lower()]
        return kind(text)  # type: ignore[operator]
    except ValueError:
        raise UserError(f"tree option {key}={text!r}: not a valid {getattr(kind, '__name__', kind)}") from None
