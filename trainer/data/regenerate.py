"""Response regeneration: replace the assistant turns of chat conversations with the target's own replies.

A drafter is judged by how often the target accepts its guesses, so it should learn what the target itself
says rather than what some other model (or a human) wrote in a public chat data set. For every conversation
the assistant turns are regenerated in order, each one conditioned on the conversation so far *with the
earlier turns already regenerated*; user, system and tool turns are kept as they are.

- The prompt of a turn is the tokenizer's chat template with the generation prompt, and a turn ends at the
  template's end-of-turn marker (``<|im_end|>`` for Qwen3, ``<|eot_id|>`` for Llama 3) or the end-of-text
  token; neither is stored in the content.
- ``batch_size`` conversations generate together (left padded); their turns advance together.
- Greedy at temperature 0, otherwise sampled with ``temperature`` / ``top_p``. Every conversation's turn draws
  from its own random stream seeded by (``seed``, id, turn), so the samples do not depend on the batch a
  conversation lands in, and a resumed run samples what an uninterrupted one would have.
- Only these arguments steer decoding: the target's own ``generation_config.json`` (hub sampling defaults,
  repetition penalties) is deliberately ignored, so the command line says everything about how data was made.
- ``--format text`` (plain text and code, e.g. ``stdlib:train``): documents are cut into windows of
  ``prompt_tokens + max_new_tokens`` tokens, and the target continues each window's first ``prompt_tokens``
  tokens; ``--limit`` keeps that many windows spread evenly over the corpus. A continuation ends at the
  end-of-text token or after ``max_new_tokens``. Each output line is ``{"id", "source", "text"}`` (prompt and
  continuation, decoded), ``id`` being ``file@offset``; training reads it as text (``format: text``), tokenized
  again (a few tokens may merge differently from the ones the target wrote).
- ``--engine vllm`` writes with vLLM's offline engine (:mod:`trainer.data.vllm_engine`): the same prompts, stop
  rule, ids, per-turn seeds, output and resume; greedy fp32 replies equal the HF engine's token for token, sampled
  ones are vLLM's own draws of the same distribution (docs/data.md, "A real run", has the measured comparison).
- The output is JSON Lines, one ``{"id", "source", "messages"}`` per input conversation in input order; ``id``
  is the input's ``file:line`` (or ``file#row``). Lines are appended and flushed as each batch finishes, so a
  run killed at any moment is resumed by running the same command again: a torn last line is cut off and
  conversations already in the output are skipped. Resuming matches ids, so pass ``--data`` spelled the
  same way.

On CPU with the shipped tiny target (from Python: :func:`regenerate`, same arguments)::

    trainer data regenerate --target checkpoints/target_tiny --data chats.jsonl --output regen.jsonl \\
        --max_new_tokens 64

or, continuing stdlib text at the temperature of the evaluation::

    trainer data regenerate --format text --target checkpoints/target_tiny --data stdlib:train \\
        --output data/regenerated/stdlib_tiny.jsonl --prompt_tokens 64 --max_new_tokens 192 --limit 1500 \\
        --temperature 0.7 --batch_size 32

"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from trainer.data.prepare import load_tokenizer
from trainer.data.render import stop_token_ids, turn_end_marker
from trainer.data.sources import LoadReport, load_chat, load_text
from trainer.data.vllm_engine import handed_over
from trainer.devices import parse_device, parse_dtype
from trainer.errors import UserError
from trainer.sampling import draw, nucleus
from trainer.target import load_causal_lm


@dataclass
class Stops:
    """The token ids that end an assistant turn, and the marker text that must never reach stored content."""

    ids: list[int]
    marker: str
    pad_id: int


@dataclass
class ResumeState:
    """What an existing output file already holds."""

    done: set[str]
    dropped_partial: bool


@dataclass
class WriteSettings:
    """How the target writes: temperature (0 = greedy), nucleus mass, length cap, seed of the sampling streams."""

    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int


@dataclass
class Engine:
    """What writes the replies: ``generate(prompts, stops, max_new_tokens, temperature, top_p, seeds)`` as
    :func:`generate_batch` after its model, and the longest prompt plus reply it can hold (None: not checked)."""

    generate: Callable[..., list[tuple[list[int], bool]]]
    context: int | None = None

    def check(self, prompts: Sequence[Sequence[int]], ids: Sequence[str], max_new_tokens: int) -> None:
        """A UserError naming the first prompt that leaves no room for ``max_new_tokens`` in the context."""
        if self.context is None:
            return
        for prompt, conversation_id in zip(prompts, ids, strict=True):
            if len(prompt) + max_new_tokens > self.context:
                raise UserError(
                    f"{conversation_id}: a prompt of {len(prompt)} tokens plus max_new_tokens={max_new_tokens} "
                    f"exceeds the target's context of {self.context} tokens (vLLM's max_model_len); lower "
                    "--max_new_tokens or drop the conversation from the data"
                )


def hf_engine(model: PreTrainedModel) -> Engine:
    """``model.generate`` in this process (:func:`generate_batch`)."""
    # generate_batch is looked up at every call, so a test that wraps the module's function wraps this engine.
    return Engine(lambda *args: generate_batch(model, *args))


def vllm_engine(target: str, dtype: str) -> Engine:
    """vLLM's offline engine in this process (:class:`trainer.data.vllm_engine.VllmGenerator`)."""
    from trainer.data.vllm_engine import VllmGenerator

    generator = VllmGenerator(target, dtype)
    return Engine(lambda prompts, stops, *args: generator(prompts, stops.ids, *args), generator.context)


def turn_seed(seed: int, conversation_id: str, turn: int) -> int:
    """A 63-bit seed for one assistant turn of one conversation, stable across runs, batches and resumes."""
    digest = hashlib.sha256(f"{seed}\0{conversation_id}\0{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class SeededSampler(LogitsProcessor):
    """Samples each row from its own generator and leaves only the chosen token finite.

    ``generate`` then runs greedy, so the argmax picks the sampled token. Drawing per row (instead of
    ``generate``'s one global stream) is what keeps a conversation's sample independent of its batch.
    """

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float) -> None:
        self.seeds = list(seeds)
        self.temperature = temperature
        self.top_p = top_p
        self.generators: list[torch.Generator] | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if self.generators is None:
            self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        probs = nucleus(torch.softmax(scores.float() / self.temperature, dim=-1), self.top_p)
        chosen = torch.stack([draw(p, g) for p, g in zip(probs, self.generators, strict=True)])
        out = torch.full_like(scores, float("-inf"))
        return out.scatter(-1, chosen[:, None], 0.0)


def stop_tokens(tokenizer: PreTrainedTokenizerBase) -> Stops:
    """The end-of-turn marker of the chat template as a token id, plus the end-of-text token
    (:func:`trainer.data.render.stop_token_ids`; the target's generation config is ignored, see above)."""
    ids = stop_token_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ids[-1]
    return Stops(ids=ids, marker=turn_end_marker(tokenizer), pad_id=pad_id)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, history: Sequence[dict], **template_kwargs: Any) -> list[int]:
    """Token ids of the conversation so far followed by the template's assistant generation prompt."""
    text = tokenizer.apply_chat_template(list(history), tokenize=False, add_generation_prompt=True, **template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@torch.no_grad()
def generate_batch(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    stops: Stops,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seeds: Sequence[int] | None = None,
) -> list[tuple[list[int], bool]]:
    """One reply per prompt: (generated ids without the stop token, whether a stop token ended it).

    Prompts are left padded to a common length; the attention mask hides the padding and ``generate``
    derives position ids from it, so a prompt's reply does not depend on the others in the batch.
    """
    device = model.device
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[stops.pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    processors = LogitsProcessorList()
    if temperature > 0:
        if seeds is None or len(seeds) != len(prompts):
            raise ValueError("sampling needs one seed per prompt")
        processors.append(SeededSampler(seeds, temperature, top_p))
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stops.ids,
        pad_token_id=stops.pad_id,
    )
    out = model.generate(
        input_ids=input_ids, attention_mask=mask, generation_config=config, logits_processor=processors
    )
    replies = []
    stop_set = set(stops.ids)
    for row in out[:, width:].tolist():
        end = next((i for i, tok in enumerate(row) if tok in stop_set), None)
        replies.append((row if end is None else row[:end], end is not None))
    return replies


def reply_text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], stops: Stops) -> str:
    """The reply as the model wrote it; cut at a marker spelled out in ordinary tokens, which a later
    rendering would read as the turn's end."""
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    return text.split(stops.marker, 1)[0]


def read_resume_state(output: Path) -> ResumeState:
    """Ids already in ``output``; a torn or unparsable last line (a kill mid-write) is cut off the file."""
    if not output.exists():
        return ResumeState(done=set(), dropped_partial=False)
    if not output.is_file():
        raise UserError(f"output {output} exists and is not a file")
    raw = output.read_bytes()
    *complete, tail = raw.split(b"\n")  # tail: the bytes after the last newline, a torn write when not empty
    done: set[str] = set()
    good_end = 0
    for lineno, line in enumerate(complete, start=1):
        if line.strip():
            conversation_id = _line_id(line)
            if conversation_id is None:
                if lineno == len(complete) and not tail:
                    break  # the last line: a write the kill damaged
                raise UserError(
                    f"output {output} line {lineno} is not a regenerated conversation (no JSON object with an "
                    "'id'); the file was not written by this command or is damaged: move it away or pass another "
                    "--output"
                )
            done.add(conversation_id)
        good_end += len(line) + 1
    dropped = good_end < len(raw)
    if dropped:
        with output.open("r+b") as f:
            f.truncate(good_end)
    return ResumeState(done=done, dropped_partial=dropped)


def _line_id(line: bytes) -> str | None:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if isinstance(record, dict) and isinstance(record.get("id"), str):
        return record["id"]
    return None


def load_target(
    target: str, dtype: str | torch.dtype, device: torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The target model (eval mode, on ``device``) and its tokenizer from the same directory or hub id."""
    model = load_causal_lm(target, dtype, device=device)
    tokenizer = load_tokenizer(target)
    # A blank config drops the target's hub sampling defaults; generate_batch passes everything it needs.
    model.generation_config = GenerationConfig()
    return model.eval(), tokenizer


def _clean(message: dict[str, Any]) -> dict[str, Any]:
    # datasets fills a missing optional field (reasoning_content) with None across the column.
    return {k: v for k, v in message.items() if v is not None}


def _regenerate_batch(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    stops: Stops,
    batch: Sequence[dict[str, Any]],
    settings: WriteSettings,
    template_kwargs: dict[str, Any],
) -> tuple[list[list[dict[str, Any]]], int]:
    """The conversations of ``batch`` with every assistant turn regenerated, and how many turns hit the cap."""
    source = [[_clean(m) for m in row["messages"]] for row in batch]
    done: list[list[dict[str, Any]]] = [[] for _ in batch]
    cursor = [0] * len(batch)
    capped = 0
    turn = 0
    while True:
        waiting = []
        for i, messages in enumerate(source):
            # Copy the turns the target does not speak until the next assistant turn.
            while cursor[i] < len(messages) and messages[cursor[i]]["role"] != "assistant":
                done[i].append(messages[cursor[i]])
                cursor[i] += 1
            if cursor[i] < len(messages):
                waiting.append(i)
        if not waiting:
            return done, capped
        prompts = [prompt_ids(tokenizer, done[i], **template_kwargs) for i in waiting]
        engine.check(prompts, [f"{batch[i]['id']} (assistant turn {turn})" for i in waiting], settings.max_new_tokens)
        seeds = [turn_seed(settings.seed, batch[i]["id"], turn) for i in waiting]
        replies = engine.generate(prompts, stops, settings.max_new_tokens, settings.temperature, settings.top_p, seeds)
        for i, (ids, stopped) in zip(waiting, replies, strict=True):
            done[i].append({"role": "assistant", "content": reply_text(tokenizer, ids, stops)})
            cursor[i] += 1
            capped += not stopped
        turn += 1


def text_stops(tokenizer: PreTrainedTokenizerBase) -> Stops:
    """Text continues until the end-of-text token (the tokenizer must have one)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError(f"the tokenizer of the target ({tokenizer.name_or_path}) has no end-of-text token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return Stops(ids=[eos], marker=tokenizer.eos_token, pad_id=pad_id)


def text_windows(
    tokenizer: PreTrainedTokenizerBase, rows: Any, prompt_tokens: int, window: int, limit: int | None
) -> list[dict[str, Any]]:
    """Prompts cut from text rows: the first ``prompt_tokens`` tokens of every ``window``-token window (the last,
    shorter one too when it holds a whole prompt), ``limit`` of them evenly spread when there are more."""
    windows = []
    for row in rows:
        ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        for offset in range(0, len(ids) - prompt_tokens + 1, window):
            prompt = ids[offset : offset + prompt_tokens]
            windows.append({"id": f"{row['source']}@{offset}", "source": row["source"], "prompt": prompt})
    if limit is not None and len(windows) > limit:
        step = len(windows) / limit
        windows = [windows[int(i * step)] for i in range(limit)]
    return windows


def _continue_batch(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    stops: Stops,
    batch: Sequence[dict[str, Any]],
    settings: WriteSettings,
) -> tuple[list[str], int]:
    """Each window's prompt and the target's continuation as text, and how many continuations hit the cap."""
    seeds = [turn_seed(settings.seed, row["id"], 0) for row in batch]
    prompts = [row["prompt"] for row in batch]
    engine.check(prompts, [row["id"] for row in batch], settings.max_new_tokens)
    replies = engine.generate(prompts, stops, settings.max_new_tokens, settings.temperature, settings.top_p, seeds)
    texts = [tokenizer.decode(row["prompt"] + ids) for row, (ids, _) in zip(batch, replies, strict=True)]
    return texts, sum(not stopped for _, stopped in replies)


def _pending(rows: Sequence[dict[str, Any]], resume: ResumeState) -> tuple[set[str], list[dict[str, Any]], int]:
    """The ids of ``rows``, the rows still to write (not in the output yet), and how many rows repeated an id (the
    same file named twice, directly and through its directory, must not be generated twice)."""
    seen: set[str] = set()
    pending: list[dict[str, Any]] = []
    repeated = 0
    for row in rows:
        if row["id"] in seen:
            repeated += 1
            continue
        seen.add(row["id"])
        if row["id"] not in resume.done:
            pending.append(row)
    return seen, pending, repeated


def _check_args(temperature: float, top_p: float, max_new_tokens: int, batch_size: int) -> None:
    if temperature < 0:
        raise UserError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise UserError(f"batch_size must be >= 1, got {batch_size}")


def _check_output_not_input(output: Path, data: Sequence[str]) -> None:
    # A resumed run would otherwise read its own output back as input conversations.
    out = output.resolve()
    for entry in map(Path, data):
        path = entry.resolve()
        if out == path or (path.is_dir() and path in out.parents and out.suffix in {".json", ".jsonl", ".parquet"}):
            raise UserError(f"output {output} is inside the input data {entry}; write it somewhere else")


def _write(
    pending: list[dict[str, Any]],
    out_path: Path,
    resumed: int,
    console: Console,
    engine: str,
    target: str,
    dtype: str,
    torch_dtype: torch.dtype,
    torch_device: torch.device,
    format: str,
    settings: WriteSettings,
    template_kwargs: dict[str, Any],
    batch_size: int,
) -> tuple[int, int]:
    """Generate the pending rows batch by batch, appending and flushing each batch's lines (the resume unit);
    returns how many rows were written and how many replies reached ``max_new_tokens``."""
    generated = capped = 0
    format_key = "text" if format == "text" else "messages"
    if engine == "vllm":
        tokenizer, writer = load_tokenizer(target), vllm_engine(target, dtype)
    else:
        model, tokenizer = load_target(target, torch_dtype, torch_device)
        writer = hf_engine(model)
    stops = text_stops(tokenizer) if format == "text" else stop_tokens(tokenizer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())  # fmt: skip
    description = f"regenerating (resumed {resumed})" if resumed else "regenerating"
    with out_path.open("a", encoding="utf-8") as f, Progress(*columns, console=console) as progress:
        task = progress.add_task(description, total=resumed + len(pending), completed=resumed)
        for start in range(0, len(pending), batch_size):
            batch = pending[start : start + batch_size]
            if format == "text":
                outputs, batch_capped = _continue_batch(writer, tokenizer, stops, batch, settings)
            else:
                outputs, batch_capped = _regenerate_batch(writer, tokenizer, stops, batch, settings, template_kwargs)
            for row, output in zip(batch, outputs, strict=True):
                record = {"id": row["id"], "source": row["source"], format_key: output}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                f.flush()
            os.fsync(f.fileno())
            generated += len(batch)
            capped += batch_capped
            progress.update(task, advance=len(batch))
    return generated, capped


def regenerate(
    target: str,
    data: list[str],
    output: str,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 512,
    batch_size: int = 8,
    seed: int = 0,
    strict: bool = False,
    dtype: str = "float32",
    device: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    format: Literal["chat", "text"] = "chat",
    prompt_tokens: int = 64,
    limit: int | None = None,
    engine: Literal["hf", "vllm"] = "hf",
    vllm_python: str | None = None,
) -> None:
    """Replace every assistant turn of chat conversations with the target model's own reply (or continue text
    prompts, ``format: text``).

    Turns are regenerated in order, each given the conversation so far with the earlier replies already
    regenerated. Rerunning the same command after an interruption resumes: conversations already in the
    output are skipped and a torn last line is cut off.

    Args:
        target: HF causal LM directory or hub id of the target; its tokenizer and chat template load from the
            same place.
        data: Chat data: JSON, JSONL or Parquet files, or directories of them (OpenAI "messages" or ShareGPT
            "conversations").
        output: Output JSONL path, one {"id", "source", "messages"} object per conversation; appended to when it
            exists (resume).
        temperature: Sampling temperature; 0 decodes greedily.
        top_p: Nucleus sampling mass, in (0, 1]; used only when temperature > 0.
        max_new_tokens: Longest reply per assistant turn, in tokens; longer replies are cut there.
        batch_size: Conversations generated together.
        seed: Seed of the sampling streams; the same seed gives the same output.
        strict: Stop at the first malformed input row instead of skipping it with a report.
        dtype: Weight dtype of the target: one of float32, bfloat16, float16.
        device: Device of the target (engine hf): cpu, cuda or cuda:N; default the first GPU when there is one,
            otherwise the CPU. vLLM runs on the device of its build.
        chat_template_kwargs: Template variables, e.g. {enable_thinking: false} for Qwen3; use the same ones
            as the training recipe's data.spec.chat_template_kwargs so prompts render as training sees them.
        format: chat (conversations) or text (plain text and code files, stdlib:train etc.; JSONL of "text").
        prompt_tokens: text only: tokens of a window the target is given; it writes max_new_tokens after them.
        limit: text only: at most this many windows, spread evenly over the corpus; default all.
        engine: what generates: hf (transformers in this process) or vllm (vLLM's offline engine: in this process
            when vLLM is importable here, else in vLLM's environment, see vllm_python); the same output either way.
        vllm_python: engine vllm only: the python of vLLM's environment, used when vLLM is not importable here;
            default $TRAINER_VLLM_PYTHON.
    """
    _check_args(temperature, top_p, max_new_tokens, batch_size)
    torch_device, torch_dtype = parse_device(device), parse_dtype(dtype)
    if prompt_tokens < 1:
        raise UserError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
    if limit is not None and limit < 1:
        raise UserError(f"limit must be >= 1, got {limit}")
    if engine == "vllm" and device is not None:
        raise UserError(f"--device {device} is for --engine hf; vLLM runs on the device of its build")
    arguments = dict(
        target=target, data=data, output=output, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
        batch_size=batch_size, seed=seed, strict=strict, dtype=dtype, chat_template_kwargs=chat_template_kwargs,
        format=format, prompt_tokens=prompt_tokens, limit=limit,
    )  # fmt: skip
    if handed_over("regenerate", engine, arguments, vllm_python):
        return
    template_kwargs = chat_template_kwargs or {}
    out_path = Path(output)
    _check_output_not_input(out_path, data)
    report = LoadReport()
    if format == "text":
        tokenizer = load_tokenizer(target)
        rows = text_windows(tokenizer, load_text(data), prompt_tokens, prompt_tokens + max_new_tokens, limit)
    else:
        rows = [{"id": row["source"], **row} for row in load_chat(data, strict=strict, report=report)]
    resume = read_resume_state(out_path)
    console = Console(stderr=True)

    seen, pending, repeated = _pending(rows, resume)
    resumed = len(seen) - len(pending)
    foreign = len(resume.done - seen)
    if foreign:
        console.print(
            f"[yellow]warning:[/] {foreign} conversations in {escape(str(out_path))} match no input id; "
            "ids are 'file:line' as the --data paths are spelled, so spell them as in the first run"
        )

    generated = capped = 0
    if pending:
        generated, capped = _write(
            pending, out_path, resumed, console, engine, target, dtype, torch_dtype, torch_device, format,
            WriteSettings(temperature, top_p, max_new_tokens, seed), dict(template_kwargs), batch_size,
        )  # fmt: skip

    items, replies = ("text windows", "continuations") if format == "text" else ("conversations", "assistant turns")
    lines = [
        f"regenerate → {out_path}: {len(seen)} {items} kept ({len(report.malformed)} malformed rows skipped"
        + (f", {repeated} repeated ids skipped" if repeated else "")
        + f"), {resumed} already done (skipped), {generated} generated",
    ]
    if capped:
        lines.append(f"  {capped} {replies} reached max_new_tokens={max_new_tokens} and were cut there")
    if resume.dropped_partial:
        lines.append("  a partial last line left by an interrupted run was removed")
    if report.malformed:
        lines.append(report.summary())
    console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)
