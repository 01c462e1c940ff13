import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
TINY_TARGET = ROOT / "checkpoints" / "target_tiny"


@pytest.fixture
def tiny_qwen3() -> Qwen3ForCausalLM:
    """A config-built 4-layer Qwen3 with hidden 32, fp32, random weights."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(config).eval()
