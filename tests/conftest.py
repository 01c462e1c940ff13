import os
import shutil

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.data.prepare import DataSpec
from trainer.training.datamodule import DraftData

ROOT = Path(__file__).resolve().parents[1]
TINY_TARGET = ROOT / "checkpoints" / "target_tiny"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """vLLM's tests need vLLM's environment: they run only when ``-m`` names the marker (``-m vllm``), so a plain
    ``pytest`` and ``pytest -m "not slow"`` leave them out alike."""
    if "vllm" in (config.getoption("markexpr") or ""):
        return
    vllm = [item for item in items if item.get_closest_marker("vllm")]
    if vllm:
        config.hook.pytest_deselected(items=vllm)
        items[:] = [item for item in items if not item.get_closest_marker("vllm")]


def reference_dflash_model():
    """The reference ``dflash.model`` module of the parity tests. Missing, it fails the test rather than skip it:
    the README's test command installs it (``pip install --no-deps dflash==0.1.0``)."""
    import importlib

    try:
        return importlib.import_module("dflash.model")
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "dflash":
            raise  # dflash is there but something it imports is not
        pytest.fail("the reference package is missing: pip install --no-deps dflash==0.1.0 (README, Quick start)")


def randomised(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every weight drawn around its init's scale (norm weights around 1), so attention is far from
    uniform and a wrong mask or position shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = 0.3 * torch.randn_like(param)
            param.copy_(1 + noise if "norm" in name else noise)
    return model


def qwen3_config(num_layers: int = 8, vocab_size: int = 97, **fields: Any) -> Qwen3Config:
    """A tiny Qwen3 config: hidden 32, MLP 64, 4 query and 2 key/value heads of 8 dims, plus ``fields``."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        **fields,
    )


@pytest.fixture
def tiny_qwen3() -> Qwen3ForCausalLM:
    """A config-built 4-layer Qwen3 with hidden 32, fp32, random weights."""
    torch.manual_seed(0)
    return Qwen3ForCausalLM(qwen3_config(4, attn_implementation="sdpa")).eval()


def make_run(out: Path, drafter: Path = ROOT / "checkpoints" / "dflash_tiny") -> Path:
    """A training run directory ``out`` as ``trainer fit`` leaves it, whose one HF export
    (``lightning_logs/version_0/hf``) is a copy of the drafter directory ``drafter``."""
    shutil.copytree(drafter, out / "lightning_logs" / "version_0" / "hf")
    return out


def make_tiny_target(out: Path, num_layers: int = 8, seed: int = 0) -> Qwen3Config:
    """Save a config-built Qwen3 target (hidden 32) with the project tokenizer into ``out``; its config."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    torch.manual_seed(seed)
    config = qwen3_config(num_layers, vocab_size=len(tok), tie_word_embeddings=True)
    Qwen3ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return config


def copy_stdlib(out: Path, n: int, split: str = "validation") -> Path:
    """The first ``n`` modules of a stdlib split as .py files in ``out`` (a small text data set)."""
    from trainer.tiny.corpus import list_modules

    out.mkdir(parents=True, exist_ok=True)
    for m in list_modules(split)[:n]:
        (out / f"{m.name}.py").write_bytes(m.path.read_bytes())
    return out


def fit_recording_losses(module, datamodule, max_steps: int, limit_val_batches: int = 1) -> list[float]:
    """``Trainer.fit`` on CPU without logger, checkpoints or progress bar; the training loss of every step."""
    import lightning as L

    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=limit_val_batches,
        num_sanity_val_steps=0,
        enable_model_summary=False,
        reload_dataloaders_every_n_epochs=1,
        callbacks=[Record()],
    )
    trainer.fit(module, datamodule=datamodule)
    return losses


def make_target_dirs(root: Path, n_modules: int) -> Qwen3Config:
    """``root/target`` (config-built 8-layer target) and ``root/text`` (``n_modules`` stdlib files); the target's
    config."""
    config = make_tiny_target(root / "target")
    copy_stdlib(root / "text", n_modules)
    return config


def make_drafter_dirs(root: Path, n_modules: int) -> Path:
    """:func:`make_target_dirs` plus ``root/dflash`` (a random 1-layer, block-8 DFlash drafter for the target)."""
    from transformers import AutoTokenizer

    from trainer.drafters.dflash import DFlashDraftModel, build_config

    target_config = make_target_dirs(root, n_modules)
    mask_id = AutoTokenizer.from_pretrained(TINY_TARGET).mask_token_id
    DFlashDraftModel(build_config(target_config, 1, 8, mask_id)).save_pretrained(root / "dflash")
    return root


def text_data(root: Path, max_length: int = 128) -> DraftData:
    """Batches of two rows of ``root/text`` tokenised by ``root/target``, a fifth of the files for validation."""
    spec = DataSpec(
        paths=[str(root / "text")],
        format="text",
        tokenizer=str(root / "target"),
        max_length=max_length,
        validation_fraction=0.2,
    )
    return DraftData(spec, batch_size=2)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness of fit of ``counts`` to ``probs``, cells with tiny expectation pooled into one."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big].double(), expected[~big].double().sum()[None]])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), stat / 2))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a test module: tiny matmuls are dominated by thread hand-offs, and with the cores shared
    they get several times slower. Modules take it with ``pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
