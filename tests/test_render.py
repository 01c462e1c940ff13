from pathlib import Path

import pytest
from conftest import TINY_TARGET
from transformers import AutoTokenizer

from trainer.data.render import render_chat, render_text, turn_end_marker

TOO_LONG = "sequence-length-is-longer-than-the-specified-maximum"
TEMPLATE = Path(__file__).parent / "data" / "qwen3_style_chat_template.jinja"


@pytest.fixture(scope="module")
def qwen3_tok():
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    tok.chat_template = TEMPLATE.read_text()
    return tok


def masked_text(tok, rendered) -> list[str]:
    """The masked tokens decoded, one string per contiguous masked run."""
    runs, current = [], []
    for tid, m in zip(rendered.input_ids, rendered.loss_mask, strict=True):
        if m:
            current.append(tid)
        elif current:
            runs.append(tok.decode(current))
            current = []
    if current:
        runs.append(tok.decode(current))
    return runs


def test_end_marker_is_learned_from_the_template(qwen3_tok):
    assert turn_end_marker(qwen3_tok) == "<|im_end|>"


def test_single_turn_thinking_on(qwen3_tok):
    msgs = [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "5"}]
    r = render_chat(qwen3_tok, msgs)
    # The last turn carries an empty think block that the model itself generates: it is learned.
    assert masked_text(qwen3_tok, r) == ["<think>\n\n</think>\n\n5<|im_end|>"]
    assert r.text.endswith("<|im_end|>\n") and r.loss_mask[-1] == 0


def test_single_turn_thinking_off(qwen3_tok):
    msgs = [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "5"}]
    r = render_chat(qwen3_tok, msgs, enable_thinking=False)
    # With thinking off the empty think block is part of the prompt, not of the answer.
    assert masked_text(qwen3_tok, r) == ["5<|im_end|>"]


def test_multi_turn_with_system_and_reasoning(qwen3_tok):
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "first?"},
        {"role": "assistant", "content": "<think>\nhidden later\n</think>\n\none"},
        {"role": "user", "content": "second?"},
        {"role": "assistant", "content": "two", "reasoning_content": "think two"},
    ]
    r = render_chat(qwen3_tok, msgs)
    assert "hidden later" not in r.text  # the template dropped the earlier turn's reasoning
    assert masked_text(qwen3_tok, r) == ["one<|im_end|>", "<think>\nthink two\n</think>\n\ntwo<|im_end|>"]
    r_off = render_chat(qwen3_tok, msgs, enable_thinking=False)
    assert masked_text(qwen3_tok, r_off)[0] == "one<|im_end|>"
    # No system, user or header token is ever learned.
    learned = "".join(masked_text(qwen3_tok, r))
    assert "You are terse" not in learned and "first?" not in learned and "<|im_start|>" not in learned


def test_three_assistant_turns_and_consecutive_assistants(qwen3_tok):
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
        {"role": "assistant", "content": "e"},
    ]
    r = render_chat(qwen3_tok, msgs)
    assert masked_text(qwen3_tok, r) == ["b<|im_end|>", "c<|im_end|>", "<think>\n\n</think>\n\ne<|im_end|>"]


def test_shipped_tiny_template_masks(qwen3_tok):
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nr\n</think>\n\nans"}]
    assert masked_text(tok, render_chat(tok, msgs)) == ["<think>\nr\n</think>\n\nans<|im_end|>"]


def test_plain_text_learns_everything_and_ends_with_eos(qwen3_tok):
    r = render_text(qwen3_tok, "def f():\n    return 1\n")
    assert all(r.loss_mask) and r.input_ids[-1] == qwen3_tok.eos_token_id


def test_long_documents_do_not_trigger_the_tokenizers_length_warning():
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    text = "def f(x):\n    return x\n" * (tokenizer.model_max_length // 4)
    assert len(render_text(tokenizer, text).input_ids) > tokenizer.model_max_length
    chat = render_chat(tokenizer, [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}])
    assert len(chat.input_ids) > tokenizer.model_max_length
    assert not tokenizer.deprecation_warnings.get(TOO_LONG)
    tokenizer(text)  # the check this guards against: a plain call does warn
    assert tokenizer.deprecation_warnings.get(TOO_LONG)
