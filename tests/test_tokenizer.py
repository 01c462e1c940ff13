import pytest
from conftest import TINY_TARGET
from transformers import AutoTokenizer

from trainer.tiny.corpus import list_modules, read_module


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_TARGET)


def test_vocab_and_special_tokens(tok):
    assert 8000 <= len(tok) <= 8200
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"):
        ids = tok.convert_tokens_to_ids([token])
        assert ids[0] != tok.unk_token_id and ids[0] is not None
        # A special token is one id, never split by BPE.
        assert tok(token, add_special_tokens=False)["input_ids"] == ids
    assert tok.mask_token == "<|mask|>"
    assert tok.eos_token == "<|endoftext|>"
    assert tok.pad_token_id == tok.eos_token_id
    assert tok.mask_token_id not in (tok.eos_token_id, tok.pad_token_id)


def test_round_trip_on_heldout_source(tok):
    texts = [t for t in map(read_module, list_modules("heldout")[:10]) if t]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        # BPE trained on code must compress it well beyond bytes.
        assert len(ids) < len(text.encode()) / 2.5


def test_round_trip_on_unseen_unicode(tok):
    text = "déjà vu — 東京 🐍\n\tx = 'ß'\r\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template_qwen3_structure(tok):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nplan\n</think>\n\nhello"},
        {"role": "user", "content": "again"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
    # Reasoning of assistant turns before the last user turn is dropped, as Qwen3 does.
    assert "<|im_start|>assistant\nhello<|im_end|>\n" in text
    assert "plan" not in text
    assert text.endswith("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    off = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    last = tok.apply_chat_template(messages[:3], tokenize=False)
    assert last.endswith("<|im_start|>assistant\n<think>\nplan\n</think>\n\nhello<|im_end|>\n")
