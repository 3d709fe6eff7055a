"""The DeepSeek router as one Triton kernel beside its torch reference.

In torch the router (fp32 logits, sigmoid/softmax, group-limited selection, top-k, renormalisation) is
about 20 kernels. Here one program per 16 tokens computes the logits tile as a pipelined GEMM over the
hidden size, the scores, the group selection (V3 `noaux_tc`: groups ranked by the sum of their top-2
biased scores; V2 `group_limited_greedy`: by their best score), the top-k experts and their weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specmla.ops.backend import pick_backend


@dataclass(frozen=True)
class RouteSpec:
    """The router's rule, from the model config."""

    top_k: int
    n_group: int = 1
    topk_group: int = 1
    method: str = "greedy"  # greedy | group_limited_greedy (V2) | noaux_tc (V3)
    sigmoid: bool = False  # scoring: sigmoid (V3) or softmax
    norm_topk_prob: bool = False
    scaling: float = 1.0
    v2: bool = False  # V2: normalise *or* scale; V3: normalise (optionally), then always scale

    @classmethod
    def from_config(cls, cfg) -> "RouteSpec":
        return cls(top_k=cfg.num_experts_per_tok, n_group=cfg.n_group or 1, topk_group=cfg.topk_group or 1,
                   method=cfg.topk_method, sigmoid=cfg.scoring_func == "sigmoid", norm_topk_prob=cfg.norm_topk_prob,
                   scaling=cfg.routed_scaling_factor, v2=cfg.model_type == "deepseek_v2")

    @property
    def group_mode(self) -> int:
        """0: no group limit; 1: V3 (top-2 sum, others -inf); 2: V2 (group max, others 0)."""
        if self.n_group <= 1:
            return 0
        return {"noaux_tc": 1, "group_limited_greedy": 2}.get(self.method, 0)


# ---- routing ---------------------------------------------------------------------------------------
def moe_route_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: RouteSpec
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], router weight [E, H], e_score_correction_bias [E] or None → (weights fp32 [T, k],
    expert ids int64 [T, k]). The math of transformers' DeepSeek V2/V3 gates."""
    logits = torch.nn.functional.linear(x.float(), weight.float())
    scores = logits.sigmoid() if spec.sigmoid else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias
    if spec.group_mode:
        grouped = choice.view(-1, spec.n_group, choice.shape[-1] // spec.n_group)
        if spec.group_mode == 1:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = group_scores.topk(spec.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
        score_mask = group_mask[:, :, None].expand_as(grouped).reshape(choice.shape)
        choice = choice.masked_fill(~score_mask, float("-inf") if spec.group_mode == 1 else 0.0)
    idx = choice.topk(spec.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, idx)
    if spec.v2:
        if spec.top_k > 1 and spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = weights * spec.scaling
    else:
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * spec.scaling
    return weights, idx


@triton.jit
def _pick_max(v, taken, offs, BLOCK: tl.constexpr):
    """Per row of v [R, C]: (value, lowest column) of the largest entry not yet taken."""
    c = tl.where(taken, float("-inf"), v)
    m = tl.max(c, 1)
    i = tl.min(tl.where((c == m[:, None]) & (taken == 0), offs[None, :], BLOCK), 1)
    return m, i


@triton.jit
def _moe_route_kernel(
    X, W, BIAS, W_OUT, I_OUT, T, H, stride_x, stride_w, scaling,
    E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
    N_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_MODE: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, V2: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """One program per BLOCK_T tokens: logits [BLOCK_T, E] as one pipelined GEMM over H, then the rule."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        x = tl.load(X + offs_t[:, None] * stride_x + offs_h[None, :], mask=t_ok[:, None] & h_ok[None, :], other=0.0)
        w = tl.load(W + offs_e[None, :] * stride_w + offs_h[:, None], mask=e_ok[None, :] & h_ok[:, None], other=0.0)
        if FP32_DOT:  # fp32 (or mixed) inputs: exact fp32 products, as the reference's fp32 linear
            logits = tl.dot(x.to(tl.float32), w.to(tl.float32), logits, input_precision="ieee")
        else:  # bf16 / fp16 products are exact in fp32, so the sum differs from fp32 only in order
            logits = tl.dot(x, w, logits)
    cols = offs_e[None, :] + tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
    valid = cols < E
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        lm = tl.where(valid, logits, float("-inf"))
        z = tl.exp(lm - tl.max(lm, 1)[:, None])
        scores = z / tl.sum(z, 1)[:, None]
    scores = tl.where(valid, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(BIAS + offs_e, mask=e_ok, other=0.0)[None, :]
    none = cols < 0  # an all-false mask
    if GROUP_MODE > 0:
        group = cols // (E // N_GROUP)
        offs_g = tl.arange(0, BLOCK_G)
        gcols = offs_g[None, :] + tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int32)
        gscore = tl.full([BLOCK_T, BLOCK_G], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            c = tl.where((group == g) & valid, choice, float("-inf"))
            m1, i1 = _pick_max(c, none, offs_e, BLOCK_E)
            if GROUP_MODE == 1:  # V3: the sum of the group's two best
                m2, _ = _pick_max(c, cols == i1[:, None], offs_e, BLOCK_E)
                m1 = m1 + m2
            gscore = tl.where(gcols == g, m1[:, None], gscore)
        chosen = gcols < 0
        for _ in tl.static_range(TOPK_GROUP):
            _, gi = _pick_max(gscore, chosen | (gcols >= N_GROUP), offs_g, BLOCK_G)
            chosen = chosen | (gcols == gi[:, None])
        keep = none
        for g in tl.static_range(N_GROUP):
            sel = tl.max(tl.where(chosen & (gcols == g), 1, 0), 1)
            keep = keep | ((group == g) & (sel[:, None] > 0))
        choice = tl.where(keep, choice, float("-inf") if GROUP_MODE == 1 else 0.0)
    choice = tl.where(valid, choice, float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    kcols = offs_k[None, :] + tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    picked_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    picked_i = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    taken = none | (cols >= E)
    for j in tl.static_range(TOP_K):
        _, i = _pick_max(choice, taken, offs_e, BLOCK_E)
        hit = cols == i[:, None]
        taken = taken | hit
        picked_w = tl.where(kcols == j, tl.sum(tl.where(hit, scores, 0.0), 1)[:, None], picked_w)
        picked_i = tl.where(kcols == j, i[:, None], picked_i)
    k_ok = kcols < TOP_K
    total = tl.sum(tl.where(k_ok, picked_w, 0.0), 1)[:, None]
    if V2:
        if NORM and TOP_K > 1:
            picked_w = picked_w / (total + 1e-20)
        else:
            picked_w = picked_w * scaling
    else:
        if NORM:
            picked_w = picked_w / (total + 1e-20)
        picked_w = picked_w * scaling
    m = t_ok[:, None] & k_ok
    out = offs_t[:, None] * TOP_K + kcols
    tl.store(W_OUT + out, picked_w, mask=m)
    tl.store(I_OUT + out, picked_i.to(I_OUT.dtype.element_ty), mask=m)


def moe_route_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: RouteSpec,
                     *, ids_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `moe_route_torch`; one launch, one program per 16 tokens."""
    T, H = x.shape
    E = weight.shape[0]
    if weight.shape[1] != H or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("router: x [T, H] and weight [E, H] must agree and be contiguous in H")
    if spec.group_mode and E % spec.n_group:
        raise ValueError(f"{E} experts do not split into {spec.n_group} groups")
    if not 1 <= spec.top_k <= E:
        raise ValueError(f"top_k={spec.top_k} must be in 1..{E}")
    weights = torch.empty(T, spec.top_k, dtype=torch.float32, device=x.device)
    idx = torch.empty(T, spec.top_k, dtype=ids_dtype, device=x.device)
    if T == 0:
        return weights, idx
    block_e = max(16, triton.next_power_of_2(E))
    block_t = 16
    block_h = max(16, min(triton.next_power_of_2(H), 8192 // block_e))
    fp32_dot = x.dtype != weight.dtype or x.dtype == torch.float32
    _moe_route_kernel[(triton.cdiv(T, block_t),)](
        x, weight, bias if bias is not None else weight, weights, idx, T, H, x.stride(0), weight.stride(0),
        float(spec.scaling),
        E=E, BLOCK_E=block_e, BLOCK_T=block_t, BLOCK_H=block_h,
        TOP_K=spec.top_k, BLOCK_K=max(2, triton.next_power_of_2(spec.top_k)),
        N_GROUP=spec.n_group, BLOCK_G=max(2, triton.next_power_of_2(spec.n_group)), TOPK_GROUP=spec.topk_group,
        GROUP_MODE=spec.group_mode, SIGMOID=spec.sigmoid, HAS_BIAS=bias is not None, NORM=spec.norm_topk_prob,
        V2=spec.v2, FP32_DOT=fp32_dot, num_warps=4, num_stages=3,
    )
    return weights, idx


def moe_route(x, weight, bias, spec: RouteSpec, *, backend: str = "auto"):
    """x [T, H], router weight [E, H], e_score_correction_bias [E] or None → (weights fp32 [T, k], expert
    ids int64 [T, k]): Triton on CUDA at inference, the torch reference elsewhere."""
    if pick_backend(backend, x, weight) == "triton":
        return moe_route_triton(x, weight, bias, spec)
    return moe_route_torch(x, weight, bias, spec)
