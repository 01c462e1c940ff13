"""The console of a run: no warning about long documents the pipeline cuts itself, and a progress bar title
that reads right in a run bounded by steps."""

from types import SimpleNamespace

from conftest import TINY_TARGET
from transformers import AutoTokenizer

from trainer.cli import StepProgressBar
from trainer.data.render import render_chat, render_text

TOO_LONG = "sequence-length-is-longer-than-the-specified-maximum"


def test_long_documents_do_not_trigger_the_tokenizers_length_warning():
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    text = "def f(x):\n    return x\n" * (tokenizer.model_max_length // 4)
    assert len(render_text(tokenizer, text).input_ids) > tokenizer.model_max_length
    chat = render_chat(tokenizer, [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}])
    assert len(chat.input_ids) > tokenizer.model_max_length
    assert not tokenizer.deprecation_warnings.get(TOO_LONG)
    tokenizer(text)  # the check this guards against: a plain call does warn
    assert tokenizer.deprecation_warnings.get(TOO_LONG)


def test_progress_bar_title_in_a_run_bounded_by_steps():
    bar = StepProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=-1)
    assert bar._get_train_description(0).rstrip() == "Epoch 0"
    bar._trainer = SimpleNamespace(max_epochs=3)
    assert bar._get_train_description(1).rstrip() == "Epoch 1/2"
