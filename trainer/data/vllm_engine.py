"""vLLM's offline engine (``vllm.LLM``) behind the data jobs' ``--engine vllm``.

- :class:`VllmGenerator` writes replies for ``trainer data regenerate``: the same prompts (our chat template code
  renders them), the same stop rule (the end-of-turn marker or end-of-text token, passed as ``stop_token_ids``
  with vLLM's own EOS rule off, the target's ``generation_config.json`` ignored) and the same seeds: a sampled
  turn draws from vLLM's per-request generator seeded with ``turn_seed(seed, id, turn)``
  (``SamplingParams(seed=...)``), so it does not depend on the batch it lands in, nor on a resume.
- :class:`VllmFeatures` computes what ``trainer data cache`` stores: the outputs of the recipe's target layers and
  the teacher's top-k. vLLM 0.32's own way to read hidden states (the ``extract_hidden_states`` speculative method
  with its ``ExampleHiddenStatesConnector``) does not serve on the CPU build: the connector copies the states
  through ``pin_memory=True``, which raises without an accelerator and kills the engine core; and it writes a
  request's states only in the engine step after the request finished, so the last requests of an offline batch
  wait for a step that never comes. So the states are read by forward hooks on the decoder layers of vLLM's own
  torch module, reached in process through ``LLM.apply_model``: a vLLM Qwen3/Llama layer returns
  ``(hidden, residual)``, and ``hidden + residual`` is the HF decoder layer's output. Each packed document is one
  request with one token sampled; the teacher's top-k are vLLM's prompt log-probs (position t's are the next
  token's distribution, the last position's are the sampled token's). One sequence per forward
  (``max_num_seqs=1``, prefix caching off), so every forward's tokens belong to one request, which the hooks check
  against the prompt token by token.
- :func:`run_in_vllm_env` runs a whole data job in vLLM's environment (``--vllm_python`` or
  ``$TRAINER_VLLM_PYTHON``; ``.ci/vllm_env DIR`` creates one) when vLLM is not importable here, as
  ``trainer export --check vllm`` does; the child dies with its parent, so a killed run leaves no writer behind.

Only vLLM's environment imports vLLM; this module imports it inside the functions that need it. On CPU, from vLLM's
environment (one engine in this process)::

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m trainer data regenerate --engine vllm \\
        --target checkpoints/target_tiny --data chats.jsonl --output regen.jsonl --max_new_tokens 64

or from the main environment, the vLLM part in vLLM's: ``TRAINER_VLLM_PYTHON=.venv-vllm/bin/python trainer data
regenerate --engine vllm ...`` (``trainer data cache --engine vllm`` alike).
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.errors import UserError
from trainer.paths import project_path

ENV_PYTHON = "TRAINER_VLLM_PYTHON"
_PR_SET_PDEATHSIG = 1


def vllm_importable() -> bool:
    """Whether this interpreter can import vLLM (then the engine runs in this process)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_python(given: str | None, command: str) -> str:
    """The python of vLLM's environment: ``given``, else ``$TRAINER_VLLM_PYTHON``; an error saying how to get one."""
    python = given or os.environ.get(ENV_PYTHON)
    if not python:
        raise UserError(
            f"trainer data {command} --engine vllm: vLLM is not importable in this Python ({sys.executable}) and no "
            f"vLLM environment was given: pass --vllm_python PATH or set ${ENV_PYTHON} to the python of vLLM's "
            "environment (.ci/vllm_env DIR creates one, with this project installed), or run the command from it"
        )
    if not Path(python).is_file():
        raise UserError(
            f"trainer data {command} --engine vllm: vLLM's python {python} (--vllm_python or ${ENV_PYTHON}) is not "
            "a file; create vLLM's environment with .ci/vllm_env DIR and point at DIR/bin/python"
        )
    return python


def _die_with_parent(parent: int) -> None:
    # Linux: the kernel kills the child when its parent dies, so a kill of the command (even SIGKILL) leaves no
    # vLLM process appending to the output while a rerun resumes it. Elsewhere the child outlives a killed parent.
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def handed_over(command: str, engine: str, kwargs: dict[str, Any], python: str | None) -> bool:
    """The one engine rule of the data jobs: ``engine`` must be hf or vllm; a vllm job where vLLM is not importable
    runs here in vLLM's environment (:func:`run_in_vllm_env`) and True says it is done. False: run in this process."""
    if engine not in ("hf", "vllm"):
        raise UserError(f"--engine {engine!r} is not one of hf, vllm")
    if engine == "hf" or vllm_importable():
        return False
    run_in_vllm_env(command, {**kwargs, "engine": engine}, python)
    return True


def run_in_vllm_env(command: str, kwargs: dict[str, Any], python: str | None) -> None:
    """Run ``trainer data COMMAND`` with ``kwargs`` (JSON-able, ``engine="vllm"``) in vLLM's environment, its output
    on this process's stdout and stderr; a failure there is a UserError here."""
    interpreter = vllm_python(python, command)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    # In a source checkout the child runs this checkout's code, whatever version vLLM's environment installed.
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    args = [interpreter, "-m", "trainer.data.vllm_main", command, json.dumps({**kwargs, "vllm_python": None})]
    parent = os.getpid()
    code = subprocess.run(args, env=env, check=False, preexec_fn=lambda: _die_with_parent(parent)).returncode
    if code == 2:  # the child's own UserError, printed there (trainer.data.vllm_main)
        raise UserError(f"trainer data {command} --engine vllm stopped in vLLM's environment ({interpreter}): above")
    if code:
        raise UserError(
            f"trainer data {command} --engine vllm failed in vLLM's environment ({interpreter}, exit code {code}); "
            "its output is above (a 'No module named trainer' there: install this project into that environment, "
            "as .ci/vllm_env does)"
        )


def _vllm_target(target: str) -> str:
    """A local target as vLLM must see it (absolute; a shipped one found from any directory), a hub id as it is."""
    path = project_path(target)
    return str(path.resolve()) if path.exists() else target


def _cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# One engine at a time for the life of the process: a second job with the same options (a library caller, the
# tests) reuses it, one with other options shuts it down first, since two engines would share one device's memory.
# So the engine users below hold their options, never the engine, and ask for it at every call.
_shared: dict[str, Any] = {"key": None, "llm": None, "capture": None}


def shared_llm(**options: Any) -> Any:
    """A ``vllm.LLM`` built with ``options`` (the one already built with them, if any)."""
    key = json.dumps(options, sort_keys=True)
    if _shared["key"] != key:
        close_shared_llm()
        from vllm import LLM

        try:
            _shared["llm"] = LLM(**options)
        except (OSError, ValueError) as e:
            raise UserError(f"vLLM cannot load target '{options['model']}': {type(e).__name__}: {e}") from None
        _shared["key"] = key
    return _shared["llm"]


def close_shared_llm() -> None:
    """Shut the shared engine down (its engine core and memory); a later job builds a new one."""
    llm = _shared["llm"]
    _shared.update(key=None, llm=None, capture=None)
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


class VllmGenerator:
    """Replies as :func:`trainer.data.regenerate.generate_batch` writes them, written by vLLM.

    Greedy at temperature 0 (the target's fp32 replies equal the HF engine's token for token on the tiny target);
    sampled otherwise, each prompt from vLLM's generator seeded by its own seed. On CPU the engine runs eagerly
    (``torch.compile`` would cost minutes of start-up there); on a GPU with CUDA graphs.
    """

    def __init__(self, target: str, dtype: str) -> None:
        self.options = dict(
            model=_vllm_target(target),
            dtype=dtype,
            enforce_eager=_cpu(),
            # The command line says everything about decoding: no sampling defaults from generation_config.json.
            generation_config="vllm",
            seed=0,
        )
        self.context: int = shared_llm(**self.options).llm_engine.model_config.max_model_len

    def __call__(
        self,
        prompts: Sequence[Sequence[int]],
        stop_ids: Sequence[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seeds: Sequence[int] | None = None,
    ) -> list[tuple[list[int], bool]]:
        """One reply per prompt: (generated ids without the stop token, whether a stop token ended it)."""
        from vllm import SamplingParams

        if temperature > 0 and (seeds is None or len(seeds) != len(prompts)):
            raise ValueError("sampling needs one seed per prompt")
        params = [
            SamplingParams(
                max_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p if temperature > 0 else 1.0,
                seed=seeds[i] if temperature > 0 and seeds is not None else None,
                # Our stop rule only: vLLM's own EOS check (the tokenizer's or generation config's) stays off.
                stop_token_ids=list(stop_ids),
                ignore_eos=True,
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        llm = shared_llm(**self.options)
        results = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        stop_set = set(stop_ids)
        replies = []
        for result in results:
            ids = list(result.outputs[0].token_ids)
            end = next((i for i, tok in enumerate(ids) if tok in stop_set), None)
            replies.append((ids if end is None else ids[:end], end is not None))
        return replies


class _Capture:
    """Forward hooks on vLLM's model: per forward, its input ids and the chosen layers' outputs (float32, CPU)."""

    def __init__(self, model: torch.nn.Module, layer_ids: Sequence[int]) -> None:
        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        embed = getattr(base, "embed_tokens", None)
        if not isinstance(layers, torch.nn.ModuleList) or not isinstance(embed, torch.nn.Module):
            raise UserError(
                f"vLLM's {type(model).__name__} has no decoder stack at .model.layers and embedding at "
                ".model.embed_tokens; the vLLM feature cache reads Llama/Qwen-style models only (use --engine hf)"
            )
        self.layer_ids = sorted(set(layer_ids))
        self.forwards: list[tuple[torch.Tensor, dict[int, torch.Tensor]]] = []
        embed.register_forward_pre_hook(self._start)
        for layer_id in self.layer_ids:
            layers[layer_id].register_forward_hook(self._keeper(layer_id))

    def _start(self, module: torch.nn.Module, args: tuple) -> None:
        self.forwards.append((args[0].detach().cpu().clone(), {}))

    def _keeper(self, layer_id: int):
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
            # (hidden, residual): the residual stream after the layer is their sum. Summed now, into a new tensor:
            # the next layer's fused add-norm updates both in place.
            if isinstance(output, tuple):
                hidden, residual = output[0], output[1]
                state = hidden if residual is None else hidden + residual
            else:
                state = output
            self.forwards[-1][1][layer_id] = state.detach().to("cpu", torch.float32, copy=True)

        return hook


class VllmFeatures:
    """What :func:`trainer.data.features.online_features` computes for packed rows, computed by vLLM.

    Each document of a row (a run of one ``doc_ids`` value) is a request of its own, its positions from 0 as the
    packed row's ``position_ids`` restart, one document per forward. Requires the engine in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here): the hooks write into this process's memory. Always eager:
    forward hooks do not fire inside a compiled graph.
    """

    def __init__(self, target: str, layer_ids: Sequence[int], topk: int, dtype: str, max_length: int) -> None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(_vllm_target(target)).get_text_config()
        except (OSError, ValueError) as e:
            raise UserError(f"cannot load target '{target}': {e}") from None
        bad = [i for i in layer_ids if not 0 <= i < config.num_hidden_layers]
        if bad:
            raise UserError(
                f"target layer ids {bad} out of range: the target has layers 0..{config.num_hidden_layers - 1}"
            )
        self.layer_ids = list(layer_ids)
        self.topk = topk
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        context = max_length + 1  # the longest document and the one token sampled after it
        self.options = dict(
            model=_vllm_target(target),
            dtype=dtype,
            enforce_eager=True,
            generation_config="vllm",
            seed=0,
            max_model_len=context,
            max_num_batched_tokens=max(context, 2048),
            max_num_seqs=1,
            enable_prefix_caching=False,
            async_scheduling=False,
            max_logprobs=topk,
        )
        self._engine()

    def _engine(self) -> tuple[Any, _Capture]:
        """The shared engine with this object's options, and the hooks on its model for this object's layers."""
        llm = shared_llm(**self.options)
        capture = _shared["capture"]
        if capture is not None and capture.layer_ids != sorted(set(self.layer_ids)):
            # Hooks of another layer set are on this engine: a fresh one keeps the two from adding up.
            close_shared_llm()
            llm, capture = shared_llm(**self.options), None
        if capture is None:
            capture = llm.apply_model(lambda model: _Capture(model, self.layer_ids))[0]
            _shared["capture"] = capture
        return llm, capture

    def __call__(self, rows: Sequence[dict[str, Sequence[int]]]) -> list[dict[str, torch.Tensor]]:
        """Per row (``input_ids``, ``doc_ids``): features (T, n·H) float32, teacher_topk_ids (T, k) long and
        teacher_topk_logprobs (T, k) float32."""
        from vllm import SamplingParams

        documents: list[list[int]] = []
        row_docs: list[int] = []
        for row in rows:
            ids, docs = list(row["input_ids"]), list(row["doc_ids"])
            starts = [i for i in range(len(ids)) if i == 0 or docs[i] != docs[i - 1]]
            row_docs.append(len(starts))
            documents += [ids[a:b] for a, b in zip(starts, [*starts[1:], len(ids)], strict=True)]
        params = SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=self.topk, logprobs=self.topk, ignore_eos=True,
            detokenize=False,
        )  # fmt: skip
        llm, capture = self._engine()
        capture.forwards.clear()
        results = llm.generate([{"prompt_token_ids": d} for d in documents], params, use_tqdm=False)
        states = self._split(documents, capture.forwards)
        per_doc = []
        for doc_states, result in zip(states, results, strict=True):
            rows_of_logprobs = [*list(result.prompt_logprobs or [None])[1:], result.outputs[0].logprobs[0]]
            ids, values = zip(*(self._top(entry) for entry in rows_of_logprobs), strict=True)
            per_doc.append(
                {
                    "features": torch.cat([doc_states[i] for i in self.layer_ids], dim=-1),
                    "teacher_topk_ids": torch.tensor(ids, dtype=torch.long),
                    "teacher_topk_logprobs": torch.tensor(values, dtype=torch.float32),
                }
            )
        out, at = [], 0
        for n in row_docs:
            docs = per_doc[at : at + n]
            at += n
            out.append({key: torch.cat([d[key] for d in docs]) for key in docs[0]})
        return out

    def _top(self, entry: dict | None) -> tuple[list[int], list[float]]:
        """The k most likely next tokens of one position (ids, log-probs descending) from vLLM's log-prob entry,
        which also holds the prompt's (or sampled) token whatever its rank."""
        if entry is None or len(entry) < self.topk:
            got = 0 if entry is None else len(entry)
            raise UserError(f"vLLM returned {got} log-probs for a position, fewer than topk={self.topk}")
        best = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[: self.topk]
        return [tok for tok, _ in best], [lp.logprob for _, lp in best]

    def _split(
        self, documents: list[list[int]], forwards: list[tuple[torch.Tensor, dict[int, torch.Tensor]]]
    ) -> list[dict[int, torch.Tensor]]:
        """The captured forwards cut into the documents' states, each forward's input ids checked against them."""
        states: list[dict[int, torch.Tensor]] = []
        f = 0
        for doc in documents:
            ids: list[torch.Tensor] = []
            parts: list[dict[int, torch.Tensor]] = []
            while sum(len(i) for i in ids) < len(doc) and f < len(forwards):
                ids.append(forwards[f][0])
                parts.append(forwards[f][1])
                f += 1
            seen = torch.cat(ids).tolist() if ids else []
            if seen != doc:
                raise UserError(
                    f"vLLM's forwards do not line up with the requests (a document of {len(doc)} tokens met "
                    f"{len(seen)} captured ones that differ); the hook capture needs one sequence per forward "
                    "(max_num_seqs=1, prefix caching off): a vLLM version that schedules otherwise is not supported"
                )
            states.append({i: torch.cat([p[i] for p in parts]) for i in self.layer_ids})
        if f != len(forwards):
            raise UserError(f"vLLM ran {len(forwards) - f} forwards beyond the requests' prompts; cannot place them")
        return states
