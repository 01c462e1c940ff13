"""Rendering conversations with the tokenizer's own chat template, and the assistant-only loss mask.

Nothing here knows a model family's header strings. The assistant spans are found from the template itself:

- a turn starts where the full rendering stops agreeing with the rendering of the history before it plus the
  generation prompt (their longest common prefix), so templates that force text into the generation prompt
  (Qwen3's empty ``<think></think>`` with thinking off) and templates that drop earlier reasoning (Qwen3's
  multi-turn) both come out right;
- a turn ends after the template's end-of-turn marker, learned by rendering a probe conversation
  (``<|im_end|>`` for Qwen3, ``<|eot_id|>`` for Llama 3); the marker is part of the span, so the drafter
  learns to stop.

A token is in the mask when its characters overlap an assistant span. On CPU::

    python -c "from transformers import AutoTokenizer; from trainer.data.render import render_chat; \\
        t = AutoTokenizer.from_pretrained('checkpoints/target_tiny'); \\
        print(render_chat(t, [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'yo'}]))"
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from transformers import PreTrainedTokenizerBase

from trainer.errors import UserError

_PROBE_USER = "Probe question 7f3a?"
_PROBE_REPLY = "Probe answer 9c2e."


@dataclass
class Rendered:
    # Shape: (T,) each
    input_ids: list[int]
    loss_mask: list[int]
    text: str


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], generation_prompt: bool, **kw: Any) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt, **kw)


def turn_end_marker(tokenizer: PreTrainedTokenizerBase, **template_kwargs: Any) -> str:
    """The text the template puts after an assistant message's content, up to its first whitespace.

    For Qwen3 ``<|im_end|>``, for Llama 3 ``<|eot_id|>``; the generation stop marker of a chat model.
    """
    return _turn_end_marker(tokenizer, tuple(sorted(template_kwargs.items())))


@lru_cache(maxsize=16)
def _turn_end_marker(tokenizer: PreTrainedTokenizerBase, template_kwargs: tuple) -> str:
    kw = dict(template_kwargs)
    user = {"role": "user", "content": _PROBE_USER}
    full = _render(tokenizer, [user, {"role": "assistant", "content": _PROBE_REPLY}], False, **kw)
    at = full.rfind(_PROBE_REPLY)
    if at < 0:
        raise UserError("the chat template does not render assistant content verbatim; cannot find turn ends")
    tail = full[at + len(_PROBE_REPLY) :]
    marker = tail.strip().split()[0] if tail.strip() else ""
    if not marker:
        raise UserError("the chat template puts nothing after an assistant turn; cannot find turn ends")
    return marker


def end_of_text_ids(tokenizer: PreTrainedTokenizerBase, eos_token_id: int | Sequence[int] | None = None) -> list[int]:
    """The tokenizer's end-of-text token and ``eos_token_id`` (a target's ``generation_config.eos_token_id``: an
    id or a list of them), without repeats."""
    extra = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    return list(dict.fromkeys(i for i in (tokenizer.eos_token_id, *extra) if i is not None))


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, eos_token_id: int | Sequence[int] | None = None) -> list[int]:
    """The ids generation stops at: the chat template's end-of-turn marker as one token (``<|im_end|>`` for
    Qwen3, ``<|eot_id|>`` for Llama 3), then :func:`end_of_text_ids`, without repeats. Regeneration and the server
    both stop by it; the server passes the target's ``generation_config.eos_token_id`` as ``eos_token_id`` (for
    Llama 3 that adds ``<|eom_id|>``), regeneration writes whole assistant turns and passes none. A tokenizer
    without a chat template, or whose marker is not one token, is a UserError."""
    if not tokenizer.chat_template:
        raise UserError(f"the tokenizer {tokenizer.name_or_path} has no chat template: no end-of-turn token")
    marker = turn_end_marker(tokenizer)
    marker_ids = tokenizer.encode(marker, add_special_tokens=False)
    if len(marker_ids) != 1:
        raise UserError(
            f"the chat template's end-of-turn marker {marker!r} is {len(marker_ids)} tokens, not one special token; "
            f"generation could not stop on it (tokenizer {tokenizer.name_or_path})"
        )
    return list(dict.fromkeys([marker_ids[0], *end_of_text_ids(tokenizer, eos_token_id)]))


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common character prefix (character-wise on purpose: spans are in characters)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _find_longest_prefix(text: str, header: str, cursor: int) -> int:
    """End of the first occurrence after ``cursor`` of the longest prefix of ``header`` (a forced tail such as
    an empty think block may be absent from earlier turns)."""
    for k in range(len(header), 0, -1):
        pos = text.find(header[:k], cursor)
        if pos >= 0:
            return pos + k
    raise UserError(f"cannot find the assistant header {header!r} in the rendered conversation")


def assistant_spans(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], **template_kwargs: Any
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the ``[start, end)`` character spans of its assistant turns."""
    full = _render(tokenizer, messages, False, **template_kwargs)
    marker = turn_end_marker(tokenizer, **template_kwargs)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True, **template_kwargs)
        start = _common_prefix(before, full)
        if start <= cursor:
            # The template rewrote the history (Qwen3 drops earlier reasoning once a later user turn exists),
            # so the renderings part before this turn: find this turn's generation prompt after the cursor.
            header = before[len(_render(tokenizer, messages[:i], False, **template_kwargs)) :]
            start = _find_longest_prefix(full, header, cursor)
        end = full.find(marker, start)
        if end < 0:
            raise UserError(f"assistant turn {i} has no end marker {marker!r} in the rendered conversation")
        end += len(marker)
        spans.append((start, end))
        cursor = end
    return full, spans


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], **template_kwargs: Any) -> Rendered:
    """Token ids of the templated conversation and a mask that is 1 on assistant tokens only."""
    text, spans = assistant_spans(tokenizer, messages, **template_kwargs)
    # verbose=False: a conversation longer than the tokenizer's model_max_length is truncated or dropped by the
    # spec's policy before any model sees it, so transformers' "longer than the maximum" warning does not apply.
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    mask = []
    for tok_start, tok_end in enc["offset_mapping"]:
        inside = any(tok_end > s and tok_start < e for s, e in spans)
        mask.append(int(inside))
    return Rendered(input_ids=list(enc["input_ids"]), loss_mask=mask, text=text)


def render_text(tokenizer: PreTrainedTokenizerBase, text: str) -> Rendered:
    """Plain text (code): every token is learned; the end-of-text token closes the document."""
    # Whole files are tokenized and cut into rows later, so a file longer than model_max_length is expected.
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        ids = [*ids, tokenizer.eos_token_id]
    return Rendered(input_ids=list(ids), loss_mask=[1] * len(ids), text=text)
