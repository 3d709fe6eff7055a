"""The DeepSeek router as one Triton kernel beside its torch reference.

In torch the router (fp32 logits, sigmoid/softmax, group-limited selection, top-k, renormalisation) is
about 20 kernels. Here programs over (16-token block, slice of H) compute partial logits (a 16-row dot;
one token alone on the CUDA cores, one warp), and the last program of a block to arrive sums them and
applies the rule: the scores, the group selection (V3 `noaux_tc`: groups ranked by the sum of their top-2
biased scores; V2 `group_limited_greedy`: by their best score), the top-k experts and their weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specmla.ops.backend import pick_backend
from specmla.ops.pdl import launch_dependents, pdl_args, wait
from specmla.ops.scratch import zeroed_scratch


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
def moe_route_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: RouteSpec,
                    *, id_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], router weight [E, H], e_score_correction_bias [E] or None → (weights fp32 [T, k],
    expert ids int64 [T, k], each minus id_offset: expert parallelism numbers a rank's experts from its first).
    The math of transformers' DeepSeek V2/V3 gates."""
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
    return weights, idx - id_offset if id_offset else idx


@triton.jit
def _order_key(v, idx, BLOCK: tl.constexpr):
    """int64 keys ordered as (v, −idx): one max-reduction finds the largest value and, among equal
    values, the lowest index (fp32 bits made monotone as signed integers in the high word)."""
    b = v.to(tl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    return (b.to(tl.int64) << 32) | (BLOCK - 1 - idx).to(tl.int64)


@triton.jit
def _key_value(key):
    """The fp32 value a key of `_order_key` holds."""
    b = (key >> 32).to(tl.int32)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _moe_route_kernel(
    X, W, BIAS, W_OUT, I_OUT, PART, COUNT, T, H, h_split, stride_x, stride_w, scaling,
    id_offset,  # subtracted from every id written (expert parallelism: ids from the rank's first expert)
    SPLIT: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
    N_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_MODE: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, V2: tl.constexpr, FP32_DOT: tl.constexpr,
    USE_DOT: tl.constexpr, GROUP_RESHAPE: tl.constexpr, PDL: tl.constexpr,
):
    """Program (token block, split) computes the logits [BLOCK_T, E] over its h_split columns of H as a
    pipelined GEMM; the last split of a token block to finish (an acq_rel counter) sums the partial
    logits in split order and applies the rule, then resets its counter for the next call.
    PDL: everything waits for the kernel before (x; the counters and partials of the previous call), the weight
    tiles too, as they are loaded in the loop with x's."""
    wait(PDL)
    launch_dependents(PDL)
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    h_end = tl.minimum(H, (pid_s + 1) * h_split)
    for h0 in range(pid_s * h_split, h_end, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < h_end
        x = tl.load(X + offs_t[:, None].to(tl.int64) * stride_x + offs_h[None, :], mask=t_ok[:, None] & h_ok[None, :],
                    other=0.0)
        if USE_DOT:
            w = tl.load(W + offs_e[None, :] * stride_w + offs_h[:, None], mask=e_ok[None, :] & h_ok[:, None],
                        other=0.0)
            if FP32_DOT:  # fp32 (or mixed) inputs: exact fp32 products, as the reference's fp32 linear
                logits = tl.dot(x.to(tl.float32), w.to(tl.float32), logits, input_precision="ieee")
            else:  # bf16 / fp16 products are exact in fp32, so the sum differs from fp32 only in order
                logits = tl.dot(x, w, logits)
        else:  # a few tokens: fp32 products on the CUDA cores
            w = tl.load(W + offs_e[:, None] * stride_w + offs_h[None, :], mask=e_ok[:, None] & h_ok[None, :],
                        other=0.0)
            logits += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
    if SPLIT > 1:
        tile = tl.arange(0, BLOCK_T)[:, None] * BLOCK_E + tl.arange(0, BLOCK_E)[None, :]
        tl.store(PART + (pid_t * SPLIT + pid_s) * (BLOCK_T * BLOCK_E) + tile, logits)
        tl.debug_barrier()  # every thread's partial is issued before the arrival is announced
        if tl.atomic_add(COUNT + pid_t, 1, sem="acq_rel") != SPLIT - 1:
            return
        # unrolled: every split's tile is requested before the sums need them
        logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            logits += tl.load(PART + (pid_t * SPLIT + s) * (BLOCK_T * BLOCK_E) + tile, cache_modifier=".cg")
        tl.store(COUNT + pid_t, 0)
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
    LOWEST: tl.constexpr = -(2**63)
    if GROUP_MODE > 0:
        if GROUP_RESHAPE:  # power-of-two groups: one reduction over each group's axis
            G: tl.constexpr = E // N_GROUP
            gkey = tl.reshape(_order_key(tl.where(valid, choice, float("-inf")), cols, BLOCK_E),
                              [BLOCK_T, N_GROUP, G])
            k1 = tl.max(gkey, 2)
            gscore = _key_value(k1)
            if GROUP_MODE == 1:  # V3: the sum of the group's two best
                gscore += _key_value(tl.max(tl.where(gkey == k1[:, :, None], LOWEST, gkey), 2))
            gidx = tl.arange(0, N_GROUP)[None, :] + tl.zeros([BLOCK_T, N_GROUP], dtype=tl.int32)
            gk = _order_key(gscore, gidx, N_GROUP)
            chosen = gidx < 0
            for _ in tl.static_range(TOPK_GROUP):
                best = tl.max(gk, 1)
                chosen = chosen | (gk == best[:, None])
                gk = tl.where(gk == best[:, None], LOWEST, gk)
            keep = tl.reshape(tl.broadcast_to(chosen[:, :, None], [BLOCK_T, N_GROUP, G]), [BLOCK_T, BLOCK_E])
        else:
            group = cols // (E // N_GROUP)
            offs_g = tl.arange(0, BLOCK_G)
            gcols = offs_g[None, :] + tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int32)
            gscore = tl.full([BLOCK_T, BLOCK_G], float("-inf"), dtype=tl.float32)
            for g in tl.static_range(N_GROUP):
                gk = tl.where((group == g) & valid, _order_key(choice, cols, BLOCK_E), LOWEST)
                k1 = tl.max(gk, 1)
                m = _key_value(k1)
                if GROUP_MODE == 1:  # V3: the sum of the group's two best
                    m += _key_value(tl.max(tl.where(gk == k1[:, None], LOWEST, gk), 1))
                gscore = tl.where(gcols == g, m[:, None], gscore)
            gk = tl.where(gcols < N_GROUP, _order_key(gscore, gcols, BLOCK_G), LOWEST)
            chosen = gcols < 0
            for _ in tl.static_range(TOPK_GROUP):
                best = tl.max(gk, 1)
                chosen = chosen | (gk == best[:, None])
                gk = tl.where(gk == best[:, None], LOWEST, gk)
            keep = cols < 0
            for g in tl.static_range(N_GROUP):
                sel = tl.max(tl.where(chosen & (gcols == g), 1, 0), 1)
                keep = keep | ((group == g) & (sel[:, None] > 0))
        choice = tl.where(keep, choice, float("-inf") if GROUP_MODE == 1 else 0.0)
    key = tl.where(valid, _order_key(choice, cols, BLOCK_E), LOWEST)
    offs_k = tl.arange(0, BLOCK_K)
    kcols = offs_k[None, :] + tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    picked_i = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, 1)
        picked_i = tl.where(kcols == j, BLOCK_E - 1 - (best & 0xFFFFFFFF).to(tl.int32)[:, None], picked_i)
        key = tl.where(key == best[:, None], LOWEST, key)
    picked_w = tl.gather(scores, picked_i, 1)
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
    tl.store(I_OUT + out, (picked_i - id_offset).to(I_OUT.dtype.element_ty), mask=m)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


MAX_PROGRAMS = 64  # small batches split H so that about this many programs stream the router weight
_COUNTERS = 64  # token blocks that may split (one arrival counter each)
MAX_PARTIAL_BYTES = 256 * 1024  # fp32 partial logits the last program of a token block sums


def moe_route_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: RouteSpec,
                     *, ids_dtype: torch.dtype = torch.int64, id_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `moe_route_torch`; one launch of (16-token block) × (slice of H) programs."""
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
    use_dot = T > 1
    block_t = 16 if use_dot else triton.next_power_of_2(T)
    block_h = max(16, min(triton.next_power_of_2(H), 128, (16384 if use_dot else 4096 // block_t) // block_e))
    fp32_dot = x.dtype != weight.dtype or x.dtype == torch.float32
    n_t = triton.cdiv(T, block_t)
    split = max(1, min(triton.cdiv(H, block_h), MAX_PROGRAMS // n_t, MAX_PARTIAL_BYTES // (4 * block_t * block_e)))
    split = split if n_t <= _COUNTERS else 1
    h_split = triton.cdiv(triton.cdiv(H, split), block_h) * block_h
    split = triton.cdiv(H, h_split)
    part = torch.empty(n_t * split * block_t * block_e if split > 1 else 1, dtype=torch.float32, device=x.device)
    _moe_route_kernel[(n_t, split)](
        x, weight, bias if bias is not None else weight, weights, idx, part,
        zeroed_scratch("moe_route", _COUNTERS, x.device), T, H, h_split,
        x.stride(0), weight.stride(0), float(spec.scaling), id_offset,
        SPLIT=split, E=E, BLOCK_E=block_e, BLOCK_T=block_t, BLOCK_H=block_h,
        TOP_K=spec.top_k, BLOCK_K=max(2, triton.next_power_of_2(spec.top_k)),
        N_GROUP=spec.n_group, BLOCK_G=max(2, triton.next_power_of_2(spec.n_group)), TOPK_GROUP=spec.topk_group,
        GROUP_MODE=spec.group_mode, SIGMOID=spec.sigmoid, HAS_BIAS=bias is not None, NORM=spec.norm_topk_prob,
        V2=spec.v2, FP32_DOT=fp32_dot, USE_DOT=use_dot,
        GROUP_RESHAPE=_pow2(E) and _pow2(spec.n_group) and block_e == E,
        num_warps=4 if use_dot else 1, num_stages=3, **pdl_args(x),
    )
    return weights, idx


def moe_route(x, weight, bias, spec: RouteSpec, *, id_offset: int = 0, backend: str = "auto"):
    """x [T, H], router weight [E, H], e_score_correction_bias [E] or None → (weights fp32 [T, k], expert
    ids int64 [T, k] minus id_offset): Triton on CUDA at inference, the torch reference elsewhere."""
    if pick_backend(backend, x, weight) == "triton":
        return moe_route_triton(x, weight, bias, spec, id_offset=id_offset)
    return moe_route_torch(x, weight, bias, spec, id_offset=id_offset)
