"""Continuous batching: many requests share one target forward per step, each verifying its own draft tree.

Requests join between steps (each is prefilled alone, then its KV cache joins the batch's) and leave between
steps (finished, or cancelled by their client). One step asks the policy for a tree builder and a budget for
the whole batch, lets every request's own drafting session build its tree, and verifies all trees in one
target forward. Each request keeps its own positions, sampling generator and stop conditions, so its output
is the one :func:`trainer.decoding.engine.generate` gives it alone (greedy exactly; sampled under its seed, since
acceptance draws one target sample per committed position from the request's generator).

The KV cache is ragged: ``(B, heads, L, dim)`` with a validity mask ``(B, L)``. A step appends ``T`` columns
(the largest tree; smaller trees are padded); the columns of rejected or padding nodes become holes, masked
out of every later step by an additive 4-D mask built from each row's validity and its tree's ancestor mask.
Column order does not matter to attention (positions are rotated into the keys). Every step already copies
the whole cache (the cache's update concatenates), and every hole is read by every later step's attention,
so holes are closed where it is cheap: after verification each row's kept columns move to the end of the
step's own ``T`` columns (a gather of ``B·T`` columns) and the block is cropped to the most any row kept, so a
step leaves ``max kept - kept`` holes per row rather than ``T - kept``. Rows are right-aligned (a row that
joins shorter is padded in front), so when rows leave, the columns no row holds any more are a leading block,
cropped as a view like trailing holes; the cache is compacted (one gather) once the holes left make up half
of it, which costs O(1) copies per column over a run.

Drafting sessions stay per request, and their drafter work is batched where the drafter allows: Token
Recycling needs no drafter forward, one adjacency is shared by all requests (its hot start) and learns every
row's verified nodes in one call; block drafters (DFlash and TreeFlash, under chain, DDTree, TreeFlash and
Graft-DFlash trees) draft every row's block in one drafter forward per drafter
(:func:`trainer.decoding.drafting.draft_blocks`). EAGLE-3 and SpecBlock still draft one request at a time: their
trees grow over several forwards whose number and width depend on each row's own frontier. A drafter's session
captures target features every step, drafting or not, so a request gets one only while the policy says the
drafter may be used (``Policy.ready``); a builder is chosen only for a batch whose rows all have its session.

On CPU with the shipped tiny target::

    python -c "
    import torch; from transformers import AutoModelForCausalLM as A
    from trainer.decoding.batch import BatchEngine, BatchRequest, Fixed
    t = A.from_pretrained('checkpoints/target_tiny', dtype=torch.float32).eval()
    e = BatchEngine(t, None, ('recycling',), Fixed('recycling', 16))
    rs = [BatchRequest(torch.tensor(p), 24) for p in ([1, 2, 3], [4, 5])]
    [e.submit(r) for r in rs]
    while e.busy: e.step()
    print([r.tokens for r in rs])"
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from trainer.decoding.builders import BUILDERS, DEFAULT_OPTIONS, make_session, session_class
from trainer.decoding.drafting import (
    BlockDraftSession,
    DraftSession,
    GraftSession,
    RecyclingSession,
    commit_verdict,
    draft_blocks,
    uses_drafter,
)
from trainer.decoding.events import Clock, Step, StepEvent, event_of, step_of
from trainer.decoding.options import TreeOptions
from trainer.decoding.verify import GREEDY, Sampling, cache_kwarg, finish_reason, verify_tree
from trainer.drafters.attention import additive_mask
from trainer.target import capture_layers, layer_features

LOG = logging.getLogger("trainer.decoding")


@dataclass(eq=False)
class BatchRequest:
    """One generation: the caller's inputs, then the engine's state and output."""

    # Shape: (P,)
    prompt: torch.Tensor
    max_new_tokens: int
    sampling: Sampling = GREEDY
    generator: torch.Generator | None = None
    stop_token_ids: frozenset[int] = frozenset()
    # Called on the engine thread with each step's newly committed tokens, then once with [] when done.
    on_tokens: Callable[[list[int], bool], None] | None = None
    # The new tokens, the prefill's first token included.
    tokens: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    finished: bool = False
    # Set from any thread; the engine drops the request before its next step.
    cancelled: bool = False
    # Why it finished: "stop" (a stop token), "length" (max_new_tokens), "cancelled", or "error" (``error``
    # says what failed).
    finish_reason: str | None = None
    error: str | None = None
    # Positions of this request in the target's cache (prompt + committed tokens before the last).
    past_len: int = 0
    sessions: dict[type, DraftSession] = field(default_factory=dict)
    # The engine's drafter version when the request got its drafter's sessions (``BatchEngine.set_drafter``):
    # what drafts its steps for its whole life; None without a drafter's session or version.
    drafter_version: int | None = None
    # Shape: (P, k): the target's top-k ids after every prompt position (``BatchEngine.prefill_topk``), or None.
    prefill_topk: torch.Tensor | None = None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)


@dataclass
class RowStep:
    """What one request's row did in one step."""

    request: BatchRequest
    # The verifier log's view of the step: tree, accepted path, logits, ms; ``step`` counts the request's steps.
    event: StepEvent
    # Tokens committed (accepted drafts then the bonus, cut at max_new_tokens or a stop token).
    new: list[int]


class Policy(Protocol):
    """Chooses the builder and budget of the next step and learns from what it cost."""

    def choose(self, batch_size: int, available: frozenset[str] | None = None) -> tuple[str, int]:
        """The arm of the next step, among the builders in ``available`` (those every row has the session
        for; None: all)."""
        ...

    def observe(self, tree: str, budget: int, batch_size: int, rows: list[RowStep], seconds: float) -> None: ...

    def ready(self, tree: str) -> bool:
        """Whether a request admitted now gets the drafting session of ``tree`` (a drafter's sessions capture
        target features every step, whether the step drafts or not)."""
        ...

    def speculating(self) -> bool:
        """Whether steps draft now or may soon: if not, a request admitted now skips the prompt evidence that
        only drafting uses (the logits of every prompt position, an LM head over the whole prompt), and the
        shared recycling adjacency learns neither its prompt nor the nodes of plain steps."""
        ...


@dataclass
class Fixed:
    """Always the same builder and budget."""

    tree: str
    budget: int

    def choose(self, batch_size: int, available: frozenset[str] | None = None) -> tuple[str, int]:
        return self.tree, self.budget

    def observe(self, tree: str, budget: int, batch_size: int, rows: list[RowStep], seconds: float) -> None:
        return None

    def ready(self, tree: str) -> bool:
        return True

    def speculating(self) -> bool:
        return self.tree != "none"


def _right_aligned(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the columns that gather its valid ones last, in their order, into as few columns as the fullest
    row needs; and the validity of the result. Shapes: (B, L) bool -> (B, W) long, (B, W) bool."""
    counts = valid.sum(1)
    width = int(counts.max()) if counts.numel() else 0
    # A stable sort puts each row's holes first and its valid columns after them, both in their order.
    order = valid.to(torch.int8).argsort(dim=1, stable=True)[:, valid.shape[1] - width :]
    return order, torch.arange(width)[None] >= width - counts[:, None]


def _columns(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``t[b, :, order[b], :]`` for every row. Shapes: (B, heads, L, dim), (B, W) -> (B, heads, W, dim)"""
    index = order.to(t.device)[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1])
    return t.gather(2, index)


class RaggedCache:
    """The batch's target KV cache: a ``DynamicCache`` of ``(B, heads, L, dim)`` layers plus ``valid`` (B, L)."""

    def __init__(self, config) -> None:
        self.config = config
        self.cache = DynamicCache(config=config)
        # Shape: (B, L) bool: column j of row b holds one of b's committed positions.
        self.valid = torch.zeros(0, 0, dtype=torch.bool)

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def _layers(self) -> list[DynamicLayer]:
        for layer in self.cache.layers:
            if type(layer) is not DynamicLayer:
                raise TypeError(f"batched verification needs full-attention caches; got a {type(layer).__name__}")
        return self.cache.layers

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for layer in self._layers():
            if layer.is_initialized:
                layer.keys, layer.values = fn(layer.keys), fn(layer.values)

    def join(self, row: DynamicCache, length: int) -> None:
        """Append a request prefilled alone (a one-row cache of ``length`` positions) as the last row. Rows are
        right-aligned (the shorter ones padded in front), so the columns of rows that leave become a leading
        block of holes, cropped as a view."""
        total = max(self.length, length)

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, 0, total - t.shape[-2], 0))

        if self.valid.shape[0] == 0:
            self.cache = row
            self.valid = torch.ones(1, length, dtype=torch.bool)
            return
        for mine, theirs in zip(self._layers(), row.layers, strict=True):
            mine.keys = torch.cat([pad(mine.keys), pad(theirs.keys)])
            mine.values = torch.cat([pad(mine.values), pad(theirs.values)])
        new = torch.zeros(1, total, dtype=torch.bool)
        new[0, total - length :] = True
        self.valid = torch.cat([torch.nn.functional.pad(self.valid, (total - self.length, 0)), new])

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not in ``rows`` (in order)."""
        if not rows:
            self.cache = DynamicCache(config=self.config)
            self.valid = torch.zeros(0, 0, dtype=torch.bool)
            return
        index = torch.tensor(rows)
        self._map(lambda t: t.index_select(0, index.to(t.device)))
        self.valid = self.valid[index]
        self._trim()

    def commit(self, appended: torch.Tensor) -> None:
        """The last forward appended ``T`` columns; ``appended`` (B, T) says which of them each row keeps. Each
        row's kept columns move to the end of the block, which is cropped to the most any row kept."""
        start = self.length
        width = appended.shape[1]
        order, appended = _right_aligned(appended)
        if appended.shape[1] < width:

            def pack(t: torch.Tensor) -> torch.Tensor:
                block = _columns(t, order + start)
                t = t[..., : start + block.shape[-2], :]
                t[..., start:, :] = block
                return t

            self._map(pack)
        self.valid = torch.cat([self.valid, appended], dim=1)
        self._trim()

    def _trim(self) -> None:
        """Crop leading and trailing holes (a view); gather the valid columns to the right once holes are half
        the cache."""
        used = self.valid.any(0).nonzero()
        begin, end = (int(used.min()), int(used.max()) + 1) if used.numel() else (0, 0)
        if end - begin < self.length:
            self._map(lambda t: t[..., begin:end, :])
            self.valid = self.valid[:, begin:end]
        counts = self.valid.sum(1)
        if counts.numel() and 2 * int(counts.max()) > self.length:
            return
        order, self.valid = _right_aligned(self.valid)
        self._map(lambda t: _columns(t, order))

    def mask(self, ancestors: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive attention mask for appending ``T`` columns: a row's node sees its row's valid columns and
        the nodes marked in ``ancestors`` (B, T, T) bool. Shape: (B, 1, T, L + T)"""
        rows, t = ancestors.shape[:2]
        visible = torch.cat([self.valid[:, None, :].expand(rows, t, -1), ancestors], dim=2)
        return additive_mask(visible[:, None].to(device), dtype)


class BatchEngine:
    """Steps a batch of requests on ``target``; ``trees`` names the builders requests can be drafted with."""

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: torch.nn.Module | None,
        trees: tuple[str, ...],
        policy: Policy,
        options: TreeOptions = DEFAULT_OPTIONS,
        on_step: Callable[[RowStep], None] | None = None,
        max_batch: int = 16,
        prefill_topk: int = 0,
        step_topk: int = 0,
    ) -> None:
        self.target = target
        self.trees = tuple(dict.fromkeys(("none", *trees)))
        self._check(drafter)
        self.drafter = drafter
        # 0: the drafter the server started with; published versions count from 1 (docs/verifier_log.md).
        self.drafter_version: int | None = None if drafter is None else 0
        self.policy = policy
        self.options = options
        self.on_step = on_step
        self.max_batch = max_batch
        # k > 0: keep each request's prompt top-k (the verifier log's prompt evidence) when its prefill computes
        # the logits of every prompt position anyway (a session learns from them); k = 0: never.
        self.prefill_topk = prefill_topk
        # The width of ``RowStep.top_ids`` handed to ``on_step`` (0: none), as ``generate``'s ``step_topk``.
        self.step_topk = step_topk
        self.device = target.device
        self.dtype = next(target.parameters()).dtype
        self.cache_kw = cache_kwarg(target)
        # One adjacency for all requests: it keeps learning across them.
        self.recycling = RecyclingSession(target.config.vocab_size, options.recycling_width, device=self.device)
        self.rows: list[BatchRequest] = []
        self.cache = RaggedCache(target.config)
        self.pending: queue.SimpleQueue[BatchRequest] = queue.SimpleQueue()
        self.steps = 0
        # Called as ``fault(phase, requests)`` before each prefill ("prefill", [request]) and each step ("step",
        # the batch's rows). Whatever it raises is handled as a failure of that phase: the seam through which
        # tests inject engine failures.
        self.fault: Callable[[str, list[BatchRequest]], None] | None = None
        # Called as ``on_failure(phase, requests, error)`` after a failed prefill or step has ended ``requests``
        # with finish reason "error" (the server counts and logs it).
        self.on_failure: Callable[[str, list[BatchRequest], BaseException], None] | None = None

    @property
    def busy(self) -> bool:
        return bool(self.rows) or not self.pending.empty()

    def submit(self, request: BatchRequest) -> None:
        """Queue a request; thread-safe. It joins the batch before the next step."""
        self.pending.put(request)

    def set_drafter(self, drafter: torch.nn.Module | None, version: int | None = None) -> None:
        """A new drafter (published as ``version``) for requests that join from now on: requests in flight keep
        their sessions and the version they were admitted with (``BatchRequest.drafter_version``). Call between
        steps. A drafter that cannot serve one of the engine's builders is a UserError and changes nothing."""
        self._check(drafter)
        self.drafter = drafter
        self.drafter_version = version

    def _check(self, drafter: torch.nn.Module | None) -> None:
        """Refuse (UserError) a drafter that cannot serve every builder of the engine: once, when it is set,
        rather than in every request's prefill."""
        for tree in self.trees:
            session_class(tree, drafter)

    def set_adjacency(self, adjacency: torch.Tensor, version: int | None = None) -> None:
        """Load a published recycling adjacency (V, k) token ids, -1 = empty, by the one merge rule
        (:meth:`~trainer.decoding.drafting.RecyclingSession.set_adjacency`). Call between steps; a wrong shape or id
        is a UserError and changes nothing."""
        self.recycling.set_adjacency(adjacency, version)

    def _sessions(self) -> dict[type, DraftSession]:
        sessions: dict[type, DraftSession] = {}
        for tree in self.trees:
            kind = BUILDERS[tree].session
            if kind in sessions:
                continue
            # Drafter-free sessions cost nothing to carry; a drafter's only while the policy may draft with it.
            if kind in (RecyclingSession, DraftSession) or self.policy.ready(tree):
                # Recycling and Graft draft from the engine's one adjacency: what every request learns and what a
                # daemon publishes (``set_adjacency``), not from an empty matrix of their own. The engine teaches
                # that adjacency once per prompt and step (``_learns_adjacency``), so a Graft session does not.
                sessions[kind] = make_session(tree, self.target, self.drafter, self.options, self.recycling)
                if isinstance(sessions[kind], GraftSession):
                    sessions[kind].learns_memory = False
        return sessions

    def _learns_adjacency(self, request: BatchRequest) -> bool:
        """Whether one of the request's sessions reads the shared adjacency (recycling or a Graft session's
        memory): the engine then teaches it the request's prompt and verified nodes, once."""
        return any(
            s is self.recycling or (isinstance(s, GraftSession) and s.memory is self.recycling)
            for s in request.sessions.values()
        )

    @staticmethod
    def _draft_blocks(rows: list[BatchRequest], kind: type[DraftSession], budget: int) -> None:
        """When the builder drafts one block from the root (its session is or holds a block drafter's), draft
        every row's block now, one forward per drafter; the builder then takes its row's block. The depth is
        the one the builder asks for: ``min(remaining, budget)``, capped at the drafter's block."""
        sessions = [r.sessions[kind] for r in rows]
        sessions = [s.draft if isinstance(s, GraftSession) else s for s in sessions]
        if not all(isinstance(s, BlockDraftSession) for s in sessions):
            return
        groups: dict[int, list[int]] = {}
        for b, session in enumerate(sessions):
            groups.setdefault(id(session.drafter), []).append(b)
        for members in groups.values():
            draft_blocks(
                [sessions[b] for b in members],
                [rows[b].tokens[-1] for b in members],
                [min(rows[b].remaining, budget) for b in members],
            )

    @staticmethod
    def _layer_sets(rows: list[BatchRequest]) -> set[tuple[int, ...]]:
        """The distinct non-empty target-layer sets the rows' sessions read."""
        return {s.layer_ids for r in rows for s in r.sessions.values() if s.layer_ids}

    def _finish(self, request: BatchRequest, reason: str) -> None:
        request.finished = True
        request.finish_reason = reason
        if request.on_tokens is not None:
            request.on_tokens([], True)

    def _finish_if_done(self, request: BatchRequest) -> None:
        """End ``request`` if the tokens it has committed end it (``finish_reason``)."""
        reason = finish_reason(request.tokens, request.max_new_tokens, request.stop_token_ids)
        if reason is not None:
            self._finish(request, reason)

    def _prefill(self, request: BatchRequest) -> DynamicCache | None:
        """Prefill alone; the request's one-row cache, or None when it already finished."""
        if self.fault is not None:
            self.fault("prefill", [request])
        request.sessions = self._sessions()
        if any(uses_drafter(kind) for kind in request.sessions):
            request.drafter_version = self.drafter_version
        sessions = list(request.sessions.values())
        speculating = self.policy.speculating()
        layer_ids = tuple(sorted({i for s in sessions for i in s.layer_ids}))
        cache = DynamicCache(config=self.target.config)
        prompt = request.prompt.to(self.device)
        with capture_layers(self.target, layer_ids) as states:
            out = self.target(
                input_ids=prompt[None],
                use_cache=True,
                logits_to_keep=0 if self._prompt_logits(sessions, speculating) else 1,
                **{self.cache_kw: cache},
            )
        logits = out.logits[0].float()
        if self.prefill_topk and logits.shape[0] == prompt.numel():
            request.prefill_topk = logits.topk(min(self.prefill_topk, logits.shape[-1]), dim=-1).indices
        request.tokens = [request.sampling.next_token(logits[-1], request.generator)]
        for session in sessions:
            if session is not self.recycling:
                session.start(prompt, layer_features(states, session.layer_ids, (0,)), logits)
        # The shared adjacency learns a prompt, as it learns a plain step's nodes, only while the policy may soon
        # draft: a top-k per admitted prompt is otherwise work for nothing.
        if speculating and self._learns_adjacency(request):
            self.recycling.start(prompt, None, logits)
        request.past_len = prompt.numel()
        if request.on_tokens is not None:
            request.on_tokens(list(request.tokens), False)
        self._finish_if_done(request)
        return None if request.finished else cache

    def _prompt_logits(self, sessions: list[DraftSession], speculating: bool) -> bool:
        """Prefill computes every prompt position's logits when a session learns from them and either the policy
        is drafting (``speculating``) or the verifier log wants the prompt's top-k (``prefill_topk``, the graft
        daemon's evidence). Otherwise only the last position's, and the shared adjacency learns nothing from the
        prompt (Graft sessions here read the engine's adjacency and never teach it themselves)."""
        needed = any(s.needs_prompt_logits for s in sessions)
        return needed and (self.prefill_topk > 0 or speculating)

    def _admit(self) -> None:
        while len(self.rows) < self.max_batch and not self.pending.empty():
            request = self.pending.get()
            if request.cancelled:
                self._finish(request, "cancelled")
                continue
            try:
                row = self._prefill(request)
                if row is not None:
                    self.cache.join(row, request.past_len)
            except Exception as e:  # a failed prefill ends its request; the batch and the queue go on
                self._fail("prefill", [request], e)
                continue
            if row is not None:
                self.rows.append(request)

    def _fail(self, phase: str, requests: list[BatchRequest], error: BaseException) -> None:
        """End ``requests`` with finish reason "error" after ``phase`` raised ``error``; tell ``on_failure``."""
        message = f"engine {phase} failed: {type(error).__name__}: {error}"
        ended = [r for r in requests if not r.finished]
        for request in ended:
            request.error = message
            try:
                self._finish(request, "error")
            except Exception:  # one consumer whose callback raises must not keep the other requests from ending
                LOG.exception("a failed request's end could not be delivered to its caller")
        if self.on_failure is not None:
            self.on_failure(phase, ended, error)

    def abort(self, phase: str, error: BaseException) -> None:
        """End every request in the batch with an error and empty it (its cache may be torn: a forward that raised
        mid-way has appended to some layers). Waiting requests stay queued."""
        rows, self.rows = self.rows, []
        self.cache = RaggedCache(self.target.config)
        self._fail(phase, rows, error)

    def _drop(self) -> None:
        """Remove finished and cancelled rows."""
        for request in self.rows:
            if request.cancelled and not request.finished:
                self._finish(request, "cancelled")
        keep = [i for i, r in enumerate(self.rows) if not r.finished]
        if len(keep) < len(self.rows):
            self.cache.keep_rows(keep)
            self.rows = [self.rows[i] for i in keep]

    @torch.inference_mode()
    def step(self) -> list[RowStep]:
        """Admit waiting requests, verify one tree per active request, commit; [] when there is nothing to do."""
        self._drop()
        self._admit()
        if not self.rows:
            return []
        try:
            if self.fault is not None:
                self.fault("step", list(self.rows))
            return self._step()
        except Exception as e:  # a failed step ends the batch's requests; the engine serves the next ones
            self.abort("step", e)
            return []

    def _step(self) -> list[RowStep]:
        start = time.perf_counter()
        rows, batch = self.rows, len(self.rows)
        # A builder is available when every row has its session (a row admitted while the policy did not want a
        # drafter's sessions has none).
        available = frozenset(t for t in self.trees if all(BUILDERS[t].session in r.sessions for r in rows))
        tree_name, budget = self.policy.choose(batch, available)
        builder = BUILDERS[tree_name]
        clock = Clock(self.device)
        forwards = [sum(s.forwards for s in r.sessions.values()) for r in rows]
        with clock("draft"):
            self._draft_blocks(rows, builder.session, budget)
        trees = [
            builder.build(r.sessions[builder.session], r.tokens[-1], budget, r.remaining, clock, self.options)
            for r in rows
        ]
        layer_ids = tuple(sorted({i for r in rows for s in r.sessions.values() for i in s.layer_ids}))
        with clock("verify"):
            width = max(t.tokens.numel() for t in trees)
            ids = torch.zeros(batch, width, dtype=torch.long)
            positions = torch.zeros(batch, width, dtype=torch.long)
            # Padding nodes see only themselves (a row of -inf would give NaN), and no real node sees them.
            ancestors = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)
            depths = []
            for b, (request, tree) in enumerate(zip(rows, trees, strict=True)):
                n = tree.tokens.numel()
                depth = tree.depths()
                depths.append(depth)
                ids[b, :n] = tree.tokens
                positions[b, :n] = request.past_len + depth
                positions[b, n:] = request.past_len
                ancestors[b, :n, :n] = tree.ancestor_mask()
            with capture_layers(self.target, layer_ids) as states:
                out = self.target(
                    input_ids=ids.to(self.device),
                    position_ids=positions.to(self.device),
                    attention_mask=self.cache.mask(ancestors, self.dtype, self.device),
                    use_cache=True,
                    **{self.cache_kw: self.cache.cache},
                )
            logits = out.logits.float()
            topk = self.step_topk if self.on_step is not None else 0
            verdicts = [
                verify_tree(tree, logits[b, : tree.tokens.numel()], r.sampling, r.generator, r.remaining,
                            r.stop_token_ids, topk)
                for b, (r, tree) in enumerate(zip(rows, trees, strict=True))
            ]
        with clock("commit"):
            paths = [v.path for v in verdicts]
            # The committed (row, node) pairs of the whole batch, indexed once: per-row tensor indexing costs more
            # than the rows' work when a step commits one token each (plain decoding at a large batch).
            row_of = torch.tensor([b for b, path in enumerate(paths) for _ in path])
            col_of = torch.tensor([node for path in paths for node in path])
            appended = torch.zeros(batch, width, dtype=torch.bool)
            appended[row_of, col_of] = True
            counts = [len(path) for path in paths]
            committed_at = (row_of.to(self.device), col_of.to(self.device))
            # Per distinct feature set: each row's committed nodes' features. Shapes: (len(path_b), n*H) views.
            features = {
                ids_: torch.split(layer_features(states, ids_, committed_at), counts) for ids_ in self._layer_sets(rows)
            }
            for b, (request, tree, verdict) in enumerate(zip(rows, trees, verdicts, strict=True)):
                # The shared recycling session is not told row by row: it learns every row's nodes at once below.
                sessions = [s for s in request.sessions.values() if s is not self.recycling]
                row_features = {layer_set: parts[b] for layer_set, parts in features.items()}
                commit_verdict(verdict, request.tokens, sessions, row_features, tree, logits[b, : tree.tokens.numel()])
                request.past_len += len(verdict.path)
            # Seconds of this step spent keeping drafting state ready rather than decoding (see ``observe`` below).
            readiness = 0.0
            if (tree_name != "none" or self.policy.speculating()) and any(self._learns_adjacency(r) for r in rows):
                # The shared adjacency learns every row's verified nodes in one call, rows in order (what one
                # call per row would leave). Shape: nodes (B, T) bool, the real nodes of each row. On a plain
                # step only while the policy may soon draft (``Policy.speculating``): a top-k per row per step is
                # what plain decoding at a large batch cannot afford.
                learn_start = time.perf_counter()
                sizes = torch.tensor([t.tokens.numel() for t in trees])
                nodes = torch.arange(width)[None] < sizes[:, None]
                self.recycling.learn(ids[nodes], logits[nodes.to(logits.device)])
                if tree_name == "none":
                    readiness = time.perf_counter() - learn_start
            self.cache.commit(appended)
        events = []
        for b, (request, tree, verdict) in enumerate(zip(rows, trees, verdicts, strict=True)):
            new = verdict.new
            used = sum(s.forwards for s in request.sessions.values()) - forwards[b]
            request.steps.append(step_of(verdict, tree, int(depths[b].max()), used, clock.seconds))
            pos = request.past_len - len(verdict.path)
            event = event_of(len(request.steps) - 1, pos, tree, verdict, logits[b, : tree.tokens.numel()],
                             clock.seconds, budget, tree_name)  # fmt: skip
            events.append(RowStep(request, event, new))
            # The step is reported before the request can finish, so a request's records precede its end.
            if self.on_step is not None:
                self.on_step(events[-1])
            if request.on_tokens is not None:
                request.on_tokens(new, False)
            self._finish_if_done(request)
        self.steps += 1
        # A plain step is charged without the learning it did for a drafting arm: that is the price of keeping
        # the arm ready, not of plain decoding, and charged to plain decoding it made the arm look closer (at four
        # requests recycling came within the ready margin because it was kept learning, 3.5% of every step).
        self.policy.observe(tree_name, budget, batch, events, time.perf_counter() - start - readiness)
        return events
