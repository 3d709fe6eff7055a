"""Torch reference of the fused MoE (contract C6): the same signature as `fused_moe`, fp32 inside; with
act_quant=True the emulation of the fp8 kernels' w8a8 arithmetic."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specmla.ops.linear.reference import act_quant_dequant_torch, weight_dequant


def check_moe_args(x, w_gate_up, w_down, topk_weights, topk_ids, shared, w_gate_up_scale, w_down_scale, out,
                   shared_scales=None, residual=None):
    """Shapes and dtypes of a `fused_moe` call; raises ValueError naming the offending argument."""
    if x.dim() != 2:
        raise ValueError(f"fused_moe: x must be [T, H], got {tuple(x.shape)}")
    T, H = x.shape
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError("fused_moe: w_gate_up must be [E, 2I, H] and w_down [E, H, I]")
    E, two_i, hw = w_gate_up.shape
    I = w_down.shape[2]
    if hw != H or two_i != 2 * I or tuple(w_down.shape[:2]) != (E, H):
        raise ValueError(f"fused_moe: w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} do not fit "
                         f"x [T, {H}] as [E, 2I, H] and [E, H, I]")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"fused_moe: topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} "
                         f"must both be [T={T}, k]")
    if topk_ids.dtype not in (torch.int32, torch.int64) or topk_ids.shape[1] < 1:
        raise ValueError("fused_moe: topk_ids must be int32 or int64 with k ≥ 1")
    if shared is not None:
        sgu, sd = shared
        if sgu.dim() != 2 or sd.dim() != 2 or sgu.shape[1] != H or sgu.shape[0] % 2 or sgu.shape[0] < 2 \
                or tuple(sd.shape) != (H, sgu.shape[0] // 2):
            raise ValueError(f"fused_moe: shared must be (w_gate_up [2·Is, {H}], w_down [{H}, Is]), got "
                             f"{tuple(sgu.shape)} and {tuple(sd.shape)}")
    fp8 = w_gate_up.dtype == torch.float8_e4m3fn
    if fp8 != (w_gate_up_scale is not None) or (w_down.dtype == torch.float8_e4m3fn) != (w_down_scale is not None):
        raise ValueError("fused_moe: float8_e4m3fn experts need w_gate_up_scale / w_down_scale, other dtypes none")
    shared_fp8 = shared is not None and any(w.dtype == torch.float8_e4m3fn for w in shared)
    if shared_fp8 != (shared_scales is not None):
        raise ValueError("fused_moe: float8_e4m3fn shared experts need shared_scales = (gate_up scale, down scale), "
                         "other shared experts none")
    if out is not None and (tuple(out.shape) != (T, H) or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"fused_moe: out must be [{T}, {H}] {x.dtype} on {x.device}")
    check_residual(residual, x)


def check_residual(residual, x) -> None:
    """A `fused_moe` residual (or None) fits x [T, H]: the same shape, dtype and device; else ValueError."""
    if residual is not None and (tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype
                                 or residual.device != x.device):
        raise ValueError(f"fused_moe: residual must be {list(x.shape)} {x.dtype} on {x.device}, got "
                         f"{list(residual.shape)} {residual.dtype} on {residual.device}")


def fused_moe_torch(x, w_gate_up, w_down, topk_weights, topk_ids, *, shared=None, w_gate_up_scale=None,
                    w_down_scale=None, shared_scales=None, out=None, residual=None, act_quant=False):
    """out[t] = Σ_j topk_weights[t, j] · w_down[e] (silu(gate_e x[t]) ⊙ up_e x[t]), e = topk_ids[t, j]; an id
    outside [0, E) adds nothing; plus the shared experts (w_gate_up_shared [2·Is, H], w_down_shared [H, Is])
    with weight 1. float8_e4m3fn weights come with fp32 block scales (`weight_dequant`; the shared experts' in
    shared_scales). fp32 inside, x's dtype out; one pass per expert that has tokens (the list of those experts
    is read on the host: a sync). residual [T, H] (x's dtype): added to the fp32 sum before the one rounding
    (out may be residual itself).

    act_quant: the fp8 Triton kernels' w8a8 arithmetic (`fused_moe_fp8_triton`), DeepSeek's inference numerics: x
    and each (token, expert) intermediate silu(gate)·up are quantised per row and group of 128 columns
    (`act_quant_torch`) before their products; each routed pair's output times its routing weight is rounded to
    x's dtype, as are the shared experts' outputs per slice of I intermediate units (the kernels' shared
    pseudo-experts, each quantised from its own first unit on), before the fp32 sum. Equals the kernels up to the
    fp32 sums' order."""
    check_moe_args(x, w_gate_up, w_down, topk_weights, topk_ids, shared, w_gate_up_scale, w_down_scale, out,
                   shared_scales, residual)
    T, H = x.shape
    E, I = w_down.shape[0], w_down.shape[2]
    act = act_quant_dequant_torch if act_quant else (lambda h: h)
    pair_out = (lambda y: y.to(x.dtype).float()) if act_quant else (lambda y: y)
    xf = act(x.float())
    acc = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < E)
    for e in ids[valid].unique().tolist():
        tok, slot = ((ids == e) & valid).nonzero(as_tuple=True)
        gu = xf[tok] @ weight_dequant(w_gate_up[e], None if w_gate_up_scale is None else w_gate_up_scale[e]).T
        h = act(F.silu(gu[:, :I]) * gu[:, I:])
        y = h @ weight_dequant(w_down[e], None if w_down_scale is None else w_down_scale[e]).T
        acc.index_add_(0, tok, pair_out(y * topk_weights[tok, slot].float()[:, None]))
    if shared is not None:
        sgu, sd = (weight_dequant(w, s) for w, s in zip(shared, shared_scales or (None, None)))
        Is = sd.shape[1]
        gu = xf @ sgu.T
        h = F.silu(gu[:, :Is]) * gu[:, Is:]
        if act_quant:  # one slice of I units at a time (the kernels' shared pseudo-experts)
            step = I or Is
            for c in range(0, Is, step):
                acc += pair_out(act(h[:, c:c + step]) @ sd[:, c:c + step].T)
        else:
            acc += h @ sd.T
    if residual is not None:
        acc += residual.float()
    if out is None:
        return acc.to(x.dtype)
    return out.copy_(acc)
