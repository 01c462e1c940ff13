"""Byte-level BPE tokenizer of the embedded tiny target, trained on the stdlib train split.

It carries what the rest of the toolkit needs from a real target's tokenizer: an end-of-text token, chat
tokens with a Qwen3-style chat template (system prompts, multi-turn, ``<think>`` blocks, ``enable_thinking``)
for tests of the chat pipeline, and a reserved ``<|mask|>`` token for DFlash block drafting.

Build it (about a minute on 2 CPU cores) into the directory the target recipe reads::

    python -m trainer.tiny.tokenizer --out checkpoints/target_tiny
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from trainer.tiny.corpus import list_modules, read_module

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END, MASK, THINK_START, THINK_END]

# Qwen3's template structure: optional system turn, `<|im_start|>role\n...<|im_end|>\n` per message, and
# assistant turns that may carry a `<think>` block; an empty think block closes a generation prompt when
# thinking is disabled. Reasoning of earlier assistant turns is dropped, as Qwen3 does.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set content = m['content'] -%}{%- set reasoning = m.get('reasoning_content', '') or '' -%}"
    "{%- if not reasoning and '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user and reasoning -%}"
    "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)


def _training_texts() -> Iterator[str]:
    for module in list_modules("train"):
        text = read_module(module)
        if text:
            yield text


def build_tokenizer(vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on the stdlib train split and wrap it as an HF fast tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        mask_token=MASK,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for the HF tokenizer files")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()
    tokenizer = build_tokenizer(args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out)
    print(f"tokenizer: {len(tokenizer)} tokens -> {args.out}")


if __name__ == "__main__":
    main()
