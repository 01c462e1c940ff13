"""The ``on_step`` hook that logs one request's verification steps, and its closing request record.

On CPU the hook hands the step's logits (Shape: (N + 1, V)) to the writer thread, which takes the top-k
log-probs of every verified node there (torch releases the GIL while it does); under greedy verification the
ids come with the step (``StepEvent.top_ids``, found with the target's choice) and the writer thread only adds the
log-softmax. At most ``max_deferred``
logits tensors per writer wait at a time (``LogWriter.deferred``); beyond that the hook reduces them itself,
so a lagging writer costs bounded memory. On an accelerator the hook reduces them where they are (cheap,
asynchronous) and only the (N + 1, k) results travel. List conversion, record assembly, validation and JSON
encoding always run on the writer thread::

    recorder = StepRecorder(writer, server="eval", request="p0", tenant=None, shareable=True,
                            drafter="dflash_tiny", drafter_version=None)
    g = generate(target, session, builder, prompt, 64, budget=16, on_step=recorder, step_topk=recorder.k)
    recorder.finish(prompt.tolist(), g.tokens)
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from trainer.decoding.events import StepEvent
from trainer.sampling import top_rows
from trainer.vlog.schema import MIN_TOPK, request_record, step_record
from trainer.vlog.writer import LogWriter

# Log-probs are logged to 1e-4 nats: short decimals halve the line and its parsing time.
LOGPROB_DECIMALS = 4


# Per thread, the log-softmax output of the last call, reused: a fresh (N + 1, V) tensor per step is a fresh
# mapping of a few MB whose page faults cost as much as the log-softmax itself.
_scratch = threading.local()


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.device.type != "cpu":
        return logits.log_softmax(-1)
    out = getattr(_scratch, "out", None)
    if out is None or out.dtype != logits.dtype or out.numel() < logits.numel():
        # A normal tensor even when made under inference mode (the engine's step): a later caller of this thread
        # outside inference mode could not write into an inference tensor.
        with torch.inference_mode(False):
            out = _scratch.out = torch.empty(logits.numel(), dtype=logits.dtype)
    return torch.log_softmax(logits, -1, out=out[: logits.numel()].view(logits.shape))


def _top(logits: torch.Tensor, k: int, top_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids and their log-probs per row. Shapes: (N + 1, V) -> (N + 1, k) each. ``top_ids`` (N + 1, >= k):
    the ids when verification found them already, else ``top_rows`` selects them (without a full-width
    ``topk``). The log-softmax is one fused pass (cheaper than a separate logsumexp)."""
    logprobs = _log_softmax(logits)
    if top_ids is None:
        return top_rows(logprobs, k)
    ids = top_ids[:, :k].contiguous()
    return ids, logprobs.gather(1, ids)


class StepRecorder:
    def __init__(
        self,
        writer: LogWriter,
        *,
        server: str,
        request: str,
        tenant: str | None,
        shareable: bool,
        drafter: str | None,
        drafter_version: str | int | None,
        k: int = MIN_TOPK,
        adjacency_version: int | None = None,
    ) -> None:
        self.writer = writer
        self.identity = {"server": server, "request": request, "tenant": tenant, "shareable": shareable}
        self.drafter = drafter
        self.drafter_version = drafter_version
        self.adjacency_version = adjacency_version
        self.k = k

    def __call__(self, event: StepEvent) -> None:
        logits = event.logits
        top_ids = event.top_ids if event.top_ids is not None and event.top_ids.shape[1] >= self.k else None
        if logits.device.type == "cpu" and self.writer.deferred.acquire(blocking=False):

            def record() -> dict:
                try:
                    return self._record(event, *_top(logits, self.k, top_ids))
                finally:
                    self.writer.deferred.release()

            self.writer.write(record)
        else:
            top = _top(logits, self.k, top_ids)
            self.writer.write(lambda: self._record(event, *top))

    def _record(self, event: StepEvent, ids: torch.Tensor, logprobs: torch.Tensor) -> dict:
        # Engine node i + 1 is draft node i: the root (engine 0) becomes parent -1. The tree lists stay numpy
        # arrays: the writer validates and encodes them as they are, without a Python object per number.
        return step_record(
            **self.identity,
            step=event.step,
            drafter=self.drafter,
            drafter_version=self.drafter_version,
            tree=event.builder,
            budget=event.budget,
            pos=event.pos,
            root=event.root,
            tokens=event.tree.tokens[1:].cpu().numpy(),
            parents=event.tree.parents[1:].cpu().numpy() - 1,
            accepted=[node - 1 for node in event.path[1:]],
            bonus=event.bonus,
            topk_ids=ids.cpu().numpy(),
            topk_logprobs=np.round(logprobs.cpu().numpy().astype(np.float64), LOGPROB_DECIMALS),
            ms=event.ms,
            adjacency_version=self.adjacency_version,
        )

    def finish(self, prompt_ids: list[int], output_ids: list[int], prefill_topk: torch.Tensor | None = None) -> None:
        """The request record, once the output is known; ``prefill_topk`` (P, k) ids, when given, becomes its
        ``prefill_topk_ids`` (converted on the writer thread)."""
        self.writer.write(
            lambda: request_record(
                **self.identity,
                prompt_ids=prompt_ids,
                output_ids=output_ids,
                prefill_topk_ids=None if prefill_topk is None else prefill_topk.tolist(),
            )
        )
