"""Fused RMSNorm (+ residual) and in-place RoPE kernels against their torch references."""

import pytest
import torch
from helpers.mla_cases import rel_err

from specmla.config import RopeConfig
from specmla.model.rope import rope_cos_sin_cache
from specmla.ops.norm import rms_norm
from specmla.ops.rope import apply_rope, apply_rope_, apply_rope_qk_


@pytest.mark.parametrize("D", [64, 320, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel(D, dtype, with_residual):
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(13, D, generator=g) * 3).to(dtype)
    r = torch.randn(13, D, generator=g).to(dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    want, want_h = rms_norm(x, w, 1e-6, r, backend="torch")
    got, got_h = rms_norm(x, w, 1e-6, r, backend="triton")
    assert got.dtype == want.dtype and rel_err(got, want) < (1e-6 if dtype == torch.float32 else 2e-3)
    assert torch.equal(got_h, want_h)


def test_rms_norm_matches_the_model_layer():
    from specmla.model.deepseek import RMSNorm

    layer = RMSNorm(48, 1e-5)
    with torch.no_grad():
        layer.weight.normal_(1, 0.1)
    x = torch.randn(3, 5, 48)
    assert torch.allclose(rms_norm(x, layer.weight, 1e-5, backend="triton")[0], layer(x), atol=1e-6)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("heads", [None, 1, 5])
def test_rope_kernel_in_place_on_a_strided_view(interleave, heads):
    cs = rope_cos_sin_cache(RopeConfig(type="yarn", factor=4.0, original_max_position_embeddings=64,
                                       mscale=0.707, mscale_all_dim=0.707), 16, 300)
    g = torch.Generator().manual_seed(1)
    T = 9
    full = torch.randn(T, heads or 1, 48, generator=g) if heads else torch.randn(T, 40, generator=g)
    view = full[..., 8:24]  # q_pe-like: a strided slice of a wider row
    positions = torch.randint(0, 300, (T,), generator=g)
    want = apply_rope(view.clone(), positions, cs, interleave)
    before = full.clone()
    apply_rope_(view, positions, cs, interleave, backend="triton")
    assert rel_err(view, want) < 1e-6
    untouched = torch.ones_like(full, dtype=torch.bool)
    untouched[..., 8:24] = False
    assert torch.equal(full[untouched], before[untouched])  # nothing outside the view changed


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("heads,T", [(1, 1), (5, 9), (16, 4)])
def test_rope_qk_kernel_rotates_q_heads_and_k_in_one_launch(interleave, heads, T):
    """q_pe and k_pe as the model has them (strided slices of q and of the kv_a output): both rotated as the
    reference, nothing else in either row changed."""
    cs = rope_cos_sin_cache(RopeConfig(type="yarn", factor=4.0, original_max_position_embeddings=64,
                                       mscale=0.707, mscale_all_dim=0.707), 16, 300)
    g = torch.Generator().manual_seed(heads + T)
    q_full, kv_full = torch.randn(T, heads, 48, generator=g), torch.randn(T, 56, generator=g)
    q_pe, k_pe = q_full[..., 32:], kv_full[:, 40:]
    positions = torch.randint(0, 300, (T,), generator=g)
    want_q, want_k = apply_rope(q_pe.clone(), positions, cs, interleave), apply_rope(k_pe.clone(), positions, cs,
                                                                                      interleave)
    q_before, kv_before = q_full.clone(), kv_full.clone()
    apply_rope_qk_(q_pe, k_pe, positions, cs, interleave, backend="triton")
    assert rel_err(q_pe, want_q) < 1e-6 and rel_err(k_pe, want_k) < 1e-6
    assert torch.equal(q_full[..., :32], q_before[..., :32]) and torch.equal(kv_full[:, :40], kv_before[:, :40])
    q2, k2 = q_before[..., 32:].clone(), kv_before[:, 40:].clone()
    apply_rope_qk_(q2, k2, positions, cs, interleave, backend="torch")
    assert torch.equal(q2, want_q) and torch.equal(k2, want_k)
    with pytest.raises(ValueError, match="rope needs"):
        apply_rope_qk_(q_pe, k_pe[:, :8], positions, cs, interleave, backend="triton")


@pytest.mark.parametrize("D", [64, 320, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_pair_kernel(D, dtype):
    """One launch for [weight_a · norm(a) | weight_b · norm(b)]: the torch reference (two norms and a
    cat), on rows of very different scales, a strided b, and a 3-d batch shape."""
    from specmla.ops.norm import rms_norm_pair

    g = torch.Generator().manual_seed(D + 1)
    a = (torch.randn(2, 7, D, generator=g) * 5).to(dtype)
    b = (torch.randn(2, 7, 2 * D, generator=g) * 0.01).to(dtype)[..., ::2]  # strided last dim
    wa = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    wb = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    want = rms_norm_pair(a, b, wa, wb, 1e-6, backend="torch")
    got = rms_norm_pair(a, b, wa, wb, 1e-6, backend="triton")
    assert got.shape == (2, 7, 2 * D) and got.dtype == want.dtype
    assert rel_err(got[..., :D], want[..., :D]) < (1e-6 if dtype == torch.float32 else 2e-3)
    assert rel_err(got[..., D:], want[..., D:]) < (1e-6 if dtype == torch.float32 else 2e-3)
    assert torch.allclose(want[..., :D], rms_norm(a, wa, 1e-6, backend="torch")[0])
    assert rms_norm_pair(a[:0], b[:0], wa, wb, 1e-6, backend="triton").shape == (0, 7, 2 * D)
    with pytest.raises(ValueError, match="must match"):
        rms_norm_pair(a, b[..., :-1], wa, wb, 1e-6, backend="triton")
    with pytest.raises(ValueError, match="must match"):
        rms_norm_pair(a, b, wa, wb[:-1], 1e-6, backend="triton")
    with pytest.raises(ValueError, match="unknown backend"):
        rms_norm_pair(a, b, wa, wb, 1e-6, backend="cuda")


def test_ops_pick_the_torch_path_when_any_tensor_needs_its_gradient():
    """The kernels have no backward: on CUDA a call where any tensor needs a gradient (a norm whose weight
    trains on a frozen input, as when only the MTP module is distilled; attention whose k or v trains) must
    take the torch path, or that tensor gets no gradient. Norms, rope and prefill share this rule."""
    from types import SimpleNamespace

    from specmla.ops.backend import pick_backend

    cuda_x = SimpleNamespace(is_cuda=True, requires_grad=False)  # the rule only reads these two
    frozen_w, trained_w = SimpleNamespace(requires_grad=False), SimpleNamespace(requires_grad=True)
    assert pick_backend("auto", cuda_x, frozen_w) == "triton"
    assert pick_backend("auto", cuda_x, trained_w) == "torch"
    assert pick_backend("auto", cuda_x, frozen_w, None, trained_w) == "torch"
    with torch.no_grad():
        assert pick_backend("auto", cuda_x, trained_w) == "triton"
    assert pick_backend("auto", SimpleNamespace(is_cuda=False, requires_grad=False), frozen_w) == "torch"
    assert pick_backend("triton", cuda_x, trained_w) == "triton"  # asked for by name
    with pytest.raises(ValueError, match="unknown backend"):
        pick_backend("cuda", cuda_x)
