"""What the plugin logs from vLLM's runner state: the top-k of verified rows, step records, request records.

Pure bookkeeping over the runner's fields (``input_batch.req_ids``, ``requests[req_id]``); no vLLM import, so
each piece runs against a fake runner in the default test suite. :mod:`trainer.integrations.vllm.hooks` calls it
from vLLM's step and catches whatever it raises.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trainer.sampling import top_rows
from trainer.vlog.recorder import LOGPROB_DECIMALS
from trainer.vlog.schema import RecordError, request_record, step_record

# vLLM's padding of ``sampled_token_ids`` after the first rejected draft.
PLACEHOLDER = -1
# Rows whose log-sum-exp is taken at once: the temporary stays at ROW_CHUNK × V floats at any batch size.
ROW_CHUNK = 32
logger = logging.getLogger("trainer.integrations.vllm")


class DeviceTop:
    """The top-k ids and log-probs (temperature 1) of a batch's logit rows, reduced off vLLM's critical path where
    the logits live. Shape: logits (R, V).

    - On a CUDA device: reduced there, asynchronously (vLLM's step only launches the kernels); only (R, k) ids and
      values cross to the host, into pinned memory, and the writer thread waits for the copy (:meth:`rows`).
    - On the CPU, where the engine thread itself would pay for the reduction (1.2 ms of a 22 ms step on the tiny
      target, measured): a copy of the logits (vLLM's sampler changes them in place) is reduced by the writer
      thread at the first :meth:`rows`, while torch releases the GIL. ``slots`` bounds how many copies wait at
      once (a slot is freed when this object is gone, whatever became of its records); without a free slot the
      reduction runs at once.
    """

    def __init__(self, logits: torch.Tensor, k: int, slots: threading.BoundedSemaphore | None = None) -> None:
        self.k = k
        self._event: Any = None
        self._pending: torch.Tensor | None = None
        self._host: tuple[np.ndarray, np.ndarray] | None = None
        logits = logits.detach()
        if logits.device.type == "cuda":
            with torch.no_grad():
                ids, logprobs = reduce_rows(logits, k)
                self._ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True).copy_(ids, non_blocking=True)
                self._logprobs = torch.empty(logprobs.shape, pin_memory=True).copy_(logprobs, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
        elif slots is not None and slots.acquire(blocking=False):
            self._pending = logits.to("cpu", copy=True)
            weakref.finalize(self, slots.release)
        else:
            self._ids, self._logprobs = (t.cpu() for t in reduce_rows(logits, k))

    def rows(self, rows: slice) -> dict[str, np.ndarray]:
        """``topk_ids`` and ``topk_logprobs`` of ``rows``; a non-finite log-prob refuses the record (a NaN or
        infinite logit is the target's fault, and the log holds finite log-probs only)."""
        if self._host is None:
            if self._pending is not None:
                self._ids, self._logprobs = reduce_rows(self._pending, self.k)
                self._pending = None
            if self._event is not None:
                self._event.synchronize()
            logprobs = np.round(self._logprobs.numpy().astype(np.float64), LOGPROB_DECIMALS)
            self._host = self._ids.numpy(), logprobs
        ids, logprobs = self._host[0][rows], self._host[1][rows]
        if not np.isfinite(logprobs).all():
            raise RecordError(f"rows {rows.start}..{rows.stop - 1} of the batch's logits hold non-finite values")
        return {"topk_ids": ids, "topk_logprobs": logprobs}


def reduce_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids and log-probs of every row, where ``logits`` are; the log-sum-exp in chunks of :data:`ROW_CHUNK`
    rows. Shape: (R, V) → (R, k) each."""
    with torch.no_grad():
        ids, values = top_rows(logits, k)
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            # numpy's subtract and exp are vectorised passes, about twice torch's on the CPU (measured at
            # 32 x 8192); the row maximum is the top-k's column 0.
            rows, high = logits.numpy(), values[:, :1].numpy()
            lse = np.empty((len(rows), 1), np.float32)
            for i in range(0, len(rows), ROW_CHUNK):
                part = rows[i : i + ROW_CHUNK]
                shifted = np.subtract(part, high[i : i + ROW_CHUNK])
                np.exp(shifted, out=shifted)
                # torch's row sum: a third of numpy's time here.
                lse[i : i + ROW_CHUNK, 0] = torch.from_numpy(shifted).sum(-1).numpy()
            return ids, values - torch.from_numpy(high + np.log(lse))
        lse = torch.cat([torch.logsumexp(rows.float(), -1, keepdim=True) for rows in logits.split(ROW_CHUNK)])
        return ids, values.float() - lse


def shareable_of(value: object) -> bool:
    """``vllm_xargs.shareable`` as a bool: true/false, 1/0 (JSON numbers or strings)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no"):
        return False
    raise ValueError(f"vllm_xargs.shareable {value!r:.40} is not one of true/false/1/0")


def identity(request_id: str, extra_args: dict[str, Any] | None) -> tuple[str | None, bool]:
    """``(tenant, shareable)`` of a request from its ``vllm_xargs``. A malformed value is logged (by the caller,
    once per request) and the request is kept private (``shareable: false``): evidence of unknown consent never
    reaches the shared state."""
    args = extra_args or {}
    tenant = args.get("tenant")
    tenant = None if tenant is None else str(tenant)
    try:
        return tenant, shareable_of(args.get("shareable", True))
    except ValueError as e:
        logger.warning("trainer plugin: request %s: %s; it is logged as not shareable", request_id, e)
        return tenant, False


def stop_ids(params: Any) -> set[int]:
    """The token ids that end a request (``check_stop``): EOS unless ignored, and ``stop_token_ids``."""
    stops = set(params.stop_token_ids or ())
    if not params.ignore_eos and params.eos_token_id is not None:
        stops.add(params.eos_token_id)
    return stops


def trimmed(output_ids: list[int], params: Any) -> list[int]:
    """A worker's view of a finished request's output cut as the scheduler cuts it (``check_stop``): at
    ``max_tokens`` and after the first stop token (:func:`stop_ids`) past ``min_tokens``. Stop strings are the
    front end's: an output they ended is logged as far as the worker computed it."""
    stops = stop_ids(params)
    out = list(output_ids[: params.max_tokens])
    for i, token in enumerate(out):
        if token in stops and i + 1 > params.min_tokens:
            return out[: i + 1]
    return out


def ended_output(output_ids: list[int], params: Any) -> list[int] | None:
    """The output of a request that ``output_ids`` finished (its length limit or a stop token, cut as
    :func:`trimmed` cuts it), or None while it goes on from the worker's view (stop strings and aborts are the
    front end's)."""
    cut = trimmed(output_ids, params)
    by_stop = bool(cut) and cut[-1] in stop_ids(params) and len(cut) > params.min_tokens
    return cut if by_stop or len(cut) >= params.max_tokens else None


@dataclass
class Served:
    """What drafts in this vLLM: the drafter's directory (None: drafter-free methods), the method as the log's
    ``tree``, the chain length, and the drafter version loaded now (0: the one vLLM started with)."""

    drafter: str | None = None
    tree: str = "vllm"
    budget: int = 0
    version: int | None = None


@dataclass
class Verified:
    """One request of the batch that verified a chain this step: its batch row, its first logit row (the root's;
    draft j's is ``first_row + j + 1``), the root's position and token, and the drafts."""

    batch_index: int
    request: str
    first_row: int
    pos: int
    root: int
    drafts: np.ndarray


def verified_rows(runner: Any, metadata: Any) -> list[Verified]:
    """The requests of the runner's batch that verify this step, in batch order (a prefill chunk or a recompute
    does not: the root is the last committed token). ``metadata``: vLLM's spec-decode metadata, None when nothing
    was drafted."""
    req_ids = runner.input_batch.req_ids
    drafts = [0] * len(req_ids) if metadata is None else metadata.num_draft_tokens
    draft_ids = np.zeros(0, np.int64) if metadata is None else metadata.draft_token_ids.cpu().numpy()
    out = []
    row = first_draft = 0
    for b, req_id in enumerate(req_ids):
        n = drafts[b]
        state = runner.requests[req_id]
        pos = state.num_computed_tokens
        if state.num_prompt_tokens <= pos == state.num_tokens - 1:
            out.append(Verified(b, req_id, row, pos, state.get_token_id(pos), draft_ids[first_draft : first_draft + n]))
        row += n + 1
        first_draft += n
    return out


@dataclass
class StepFields:
    """The runner-side part of one request's step record; the top-k rows are added on the writer thread."""

    batch_index: int
    first_row: int
    record: dict = field(default_factory=dict)

    def make(self, top: DeviceTop) -> dict:
        rows = slice(self.first_row, self.first_row + len(self.record["tokens"]) + 1)
        return step_record(**self.record, **top.rows(rows))


class Recorder:
    """Step and request records from the runner's state: per-request step counters and identities, the served
    drafter and the version that drafted the pending drafts, the timings of the step."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.served = Served()
        self.steps: dict[str, int] = {}
        self.identities: dict[str, tuple[str | None, bool]] = {}
        # The drafter and adjacency versions (and the milliseconds) that made the drafts this step verifies.
        self.drafted_version: int | None = None
        self.drafted_adjacency: int | None = None
        self.draft_ms = 0.0

    def identity_of(self, request_id: str, extra_args: dict[str, Any] | None) -> tuple[str | None, bool]:
        if request_id not in self.identities:
            self.identities[request_id] = identity(request_id, extra_args)
        return self.identities[request_id]

    def step_fields(self, runner: Any, metadata: Any, sampled: np.ndarray, verify_ms: float) -> list[StepFields]:
        """The step records of every request of the batch that verified this step (prefill chunks are not
        steps). ``sampled`` (B, max N + 1) committed tokens, -1 padded; ``metadata`` vLLM's spec-decode metadata
        (None when nothing was drafted)."""
        ms = {"draft": self.draft_ms, "tree": 0.0, "verify": verify_ms}
        out = []
        for row in verified_rows(runner, metadata):
            valid = sampled[row.batch_index][sampled[row.batch_index] != PLACEHOLDER]
            state = runner.requests[row.request]
            tenant, shareable = self.identity_of(row.request, state.sampling_params.extra_args)
            step = self.steps.get(row.request, 0)
            self.steps[row.request] = step + 1
            n = len(row.drafts)
            drafted = self.served.drafter is not None
            record = dict(
                server=self.server, request=row.request, tenant=tenant, shareable=shareable, step=step,
                drafter=self.served.drafter, drafter_version=self.drafted_version if drafted else None,
                tree=self.served.tree, budget=max(self.served.budget, n), pos=row.pos, root=row.root,
                tokens=row.drafts, parents=np.arange(-1, n - 1), accepted=list(range(len(valid) - 1)),
                bonus=int(valid[-1]), ms=ms, adjacency_version=self.drafted_adjacency,
            )  # fmt: skip
            out.append(StepFields(row.batch_index, row.first_row, record))
        return out

    def request_record(self, request_id: str, params: Any, prompt_ids: list[int], output_ids: list[int]) -> dict:
        """The request record of a finished request; forgets its counters."""
        self.steps.pop(request_id, None)
        tenant, shareable = self.identity_of(request_id, params.extra_args)
        self.identities.pop(request_id, None)
        return request_record(server=self.server, request=request_id, tenant=tenant, shareable=shareable,
                              prompt_ids=list(prompt_ids or []), output_ids=list(output_ids))  # fmt: skip
