"""Gradient checkpointing of the drafters' decoder layers (``trainer.callbacks.GradientCheckpointing``) changes no
loss and no gradient, also when a layer writes a KV cache that later calls read.

Regression: ``specblock_qwen3_8b`` (FSDP2, bf16, the callback) failed in its first backward at the GPU scale runs
with "The size of tensor a (704) must match the size of tensor b (640)": HF's checkpointed layer replayed its whole
forward in the backward, and the replay appended the layer's keys to the unroll's ``DynamicCache`` a second time,
after the launched blocks' keys, so the recomputed attention met more keys than its mask. The layer now replays
only a part without side effects, over the cached keys as they were before it ran (``DrafterDecoderLayer``).
"""

import types

import pytest
import torch
from conftest import make_target_dirs, qwen3_config, text_data
from transformers import DynamicCache

from trainer.callbacks import GradientCheckpointing
from trainer.data.features import with_features
from trainer.drafters.common import DrafterDecoderLayer
from trainer.drafters.specblock import LayerShift
from trainer.training.dflash import DFlashTraining
from trainer.training.specblock import SpecBlockTraining


def checkpointing(module, on: bool) -> None:
    """The recipes' callback turns it on (the runs without it come first)."""
    if on:
        GradientCheckpointing().on_fit_start(None, module)
    assert all(layer.gradient_checkpointing is on for layer in module.drafter.layers)


def grads(loss: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The gradients of ``params`` by ``loss.backward()`` (a reentrant checkpoint refuses ``autograd.grad``)."""
    for p in params:
        p.grad = None
    loss.backward()
    return [p.grad for p in params]


def assert_same(first: list, second: list) -> None:
    for a, b in zip(first, second, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpointed_layer_writes_the_cache_once_and_keeps_its_gradients(use_reentrant):
    """A layer called with P cached keys leaves P + Q in the cache, in its forward and after the backward, and
    gives the gradients of the uncheckpointed layer (of its weights, its input and the cached keys)."""
    torch.manual_seed(0)
    config = qwen3_config(2)
    layer = DrafterDecoderLayer(config, 1, LayerShift(config.hidden_size)).train()
    b, n, k, p = 2, 3, 4, 5
    hidden = torch.randn(b, n, k, config.hidden_size, requires_grad=True)
    past_keys = torch.randn(b, 2, p, 8, requires_grad=True)
    past_values = torch.randn(b, 2, p, 8, requires_grad=True)
    cos, sin = torch.randn(b, n * k, 8), torch.randn(b, n * k, 8)
    mask = torch.randn(b, 1, n * k, p + n * k)
    inputs = [hidden, past_keys, past_values, *layer.parameters()]
    results = []
    for on in (False, True):
        layer.gradient_checkpointing = on
        layer._gradient_checkpointing_func = lambda fn, *args: torch.utils.checkpoint.checkpoint(
            fn, *args, use_reentrant=use_reentrant
        )
        cache = DynamicCache(config=config)
        cache.update(past_keys, past_values, 1)
        out = layer(hidden, (cos, sin), mask, cache)
        assert cache.get_seq_length(1) == p + n * k
        # A later call reads this call's keys (as a launched block reads the context's), then one loss.
        loss = out.square().sum() + cache.layers[1].keys.sin().sum() + cache.layers[1].values.cos().sum()
        results.append((loss.detach(), grads(loss, inputs)))
        assert cache.get_seq_length(1) == p + n * k
    (loss_off, grads_off), (loss_on, grads_on) = results
    torch.testing.assert_close(loss_on, loss_off)
    assert_same(grads_on, grads_off)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpointing")
    make_target_dirs(root, 8)
    return root


def configured(module, dirs):
    data = text_data(dirs, max_length=64)
    data.setup("fit")
    module._trainer = types.SimpleNamespace(datamodule=data)
    module.configure_model()
    module._trainer = None
    module.train()
    return module, with_features(next(iter(data.train_dataloader())), module.target, module.topk)


def test_specblock_unroll_under_checkpointing_has_the_same_loss_and_gradients(dirs):
    """The SpecBlock unroll (context blocks, then launched blocks over the cached context keys, in chunks) backs
    through checkpointed layers, with the loss and the gradients of the uncheckpointed run."""
    module, batch = configured(
        SpecBlockTraining(target=str(dirs / "target"), draft_vocab_size=None, max_anchors=6, launch_chunks=2), dirs
    )
    params = [p for p in module.drafter.parameters() if p.requires_grad]
    results = []
    for on in (False, True):
        checkpointing(module, on)
        loss = module.losses(module.unroll(batch)).loss
        results.append((loss.detach(), grads(loss, params)))
    (loss_off, grads_off), (loss_on, grads_on) = results
    torch.testing.assert_close(loss_on, loss_off)
    assert_same(grads_on, grads_off)


def test_dflash_training_under_checkpointing_has_the_same_loss_and_gradients(dirs):
    module, batch = configured(
        DFlashTraining(target=str(dirs / "target"), num_layers=2, block_size=4, max_anchors=4, mask_token_id=3), dirs
    )
    params = [p for p in module.drafter.parameters() if p.requires_grad]
    results = []
    for on in (False, True):
        checkpointing(module, on)
        torch.manual_seed(0)
        loss = module.training_step(batch, 0)
        results.append((loss.detach(), grads(loss, params)))
    (loss_off, grads_off), (loss_on, grads_on) = results
    torch.testing.assert_close(loss_on, loss_off)
    assert_same(grads_on, grads_off)
