"""The recipes' optimisers: Muon's orthogonalisation, the AdamW half of MuonAdamW, the parameter split."""

import pytest
import torch
from conftest import qwen3_config
from transformers import Qwen3ForCausalLM

from trainer.optim import MuonAdamW, muon_warmup_cosine, orthogonalize


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (48, 48)])
def test_orthogonalize_flattens_the_spectrum(shape):
    g = torch.Generator().manual_seed(0)
    # An ill-conditioned matrix: singular values spread over three decades.
    u, _, v = torch.linalg.svd(torch.randn(shape, generator=g), full_matrices=False)
    spread = torch.logspace(0, -3, min(shape))
    m = u @ torch.diag(spread) @ v
    out = orthogonalize(m)
    s = torch.linalg.svdvals(out)
    assert out.shape == m.shape
    # Every direction above the noise floor comes out with a singular value near 1, and the singular vectors
    # are those of the input (U V^T up to the singular values).
    assert s[: min(shape) // 2].min() > 0.6 and s.max() < 1.25
    assert torch.allclose(out, u @ torch.diag(s.sort(descending=True).values) @ v, atol=0.15)


def test_adamw_groups_match_torch_adamw():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(6, 5))
    b = torch.nn.Parameter(a.detach().clone())
    ours = MuonAdamW([{"params": [a], "muon": False, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95))
    ref = torch.optim.AdamW([b], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(5):
        grad = torch.randn(6, 5)
        a.grad, b.grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_muon_step_has_the_adamw_rms_and_the_gradient_direction():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(64, 32))
    opt = MuonAdamW([{"params": [w], "muon": True, "weight_decay": 0.0}], lr=1e-2, momentum=0.0)
    grad = torch.randn(64, 32)
    w.grad = grad
    opt.step()
    rms = w.detach().pow(2).mean().sqrt()
    # An orthogonal (64, 32) matrix has RMS 1/sqrt(64); scaled by 0.2·sqrt(64)·lr that is 0.2·lr.
    assert rms == pytest.approx(0.2 * 1e-2, rel=0.25)
    assert (w.detach() * grad).sum() < 0


def test_muon_groups_refuse_vectors():
    with pytest.raises(ValueError, match="2-D"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(4))], "muon": True}], lr=1e-3)
    with pytest.raises(ValueError, match="muon=True or muon=False"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(4))]}], lr=1e-3)


def test_muon_split_of_a_qwen3_model():
    model = Qwen3ForCausalLM(qwen3_config())
    opt = muon_warmup_cosine(model, 0.02, 3e-3, 0.1, 10, 100, 0.1)["optimizer"]
    groups = {(g["muon"], g["weight_decay"] > 0): g["params"] for g in opt.param_groups}
    embed = model.get_input_embeddings().weight
    assert any(p is embed for p in groups[(False, True)])
    assert all(p.ndim == 2 and p is not embed for p in groups[(True, True)])
    assert all(p.ndim == 1 for p in groups[(False, False)])
    assert sum(len(ps) for ps in groups.values()) == len(list(model.parameters()))
