"""MoE routing and small-batch expert compute as three Triton kernels, each beside its torch reference.

A decode step of a small batch is a chain of tiny kernels, each costing a few µs in a CUDA graph
whatever it computes: in torch, the DeepSeek router (fp32 logits, sigmoid/softmax, group-limited
selection, top-k, renormalisation) is about 20 kernels and the gathered experts plus the shared
expert about 15 more. Here:

- `moe_route`: one program per token computes the router logits, scores, the group selection
  (V3 `noaux_tc`: groups ranked by the sum of their top-2 biased scores; V2
  `group_limited_greedy`: by their best score), the top-k experts and their weights.
- `moe_experts`: (1) one program per (token·slot, intermediate block) computes silu(x·Wg)·(x·Wu)
  for its slot, where a token's slots are its top-k routed experts followed by the shared experts
  (cut into pseudo-experts of the routed width: the activation is per intermediate unit, so the
  split is exact); (2) one program per (token, output block) sums the weighted down projections.
  Every chosen expert's weights are read once per token, so this suits batches with
  tokens·top_k ≲ 2·E (larger batches read every expert anyway and use a dense GEMM path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


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
    """(value, lowest index) of the largest entry of v not yet taken."""
    c = tl.where(taken, float("-inf"), v)
    m = tl.max(c, 0)
    i = tl.min(tl.where((c == m) & (taken == 0), offs, BLOCK), 0)
    return m, i


@triton.jit
def _moe_route_kernel(
    X, W, BIAS, W_OUT, I_OUT, H, stride_x, stride_w, scaling,
    E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
    N_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_MODE: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, V2: tl.constexpr,
):
    t = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    logits = tl.zeros([BLOCK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        x = tl.load(X + t * stride_x + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(W + offs_e[:, None] * stride_w + offs_h[None, :], mask=e_ok[:, None] & h_ok[None, :],
                    other=0.0).to(tl.float32)
        logits += tl.sum(w * x[None, :], 1)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        z = tl.exp(tl.where(e_ok, logits, float("-inf")) - tl.max(tl.where(e_ok, logits, float("-inf")), 0))
        scores = z / tl.sum(z, 0)
    scores = tl.where(e_ok, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(BIAS + offs_e, mask=e_ok, other=0.0)
    none = offs_e < 0  # an all-false mask
    if GROUP_MODE > 0:
        group = offs_e // (E // N_GROUP)
        offs_g = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            c = tl.where((group == g) & e_ok, choice, float("-inf"))
            m1, i1 = _pick_max(c, none, offs_e, BLOCK_E)
            if GROUP_MODE == 1:  # V3: the sum of the group's two best
                m2, _ = _pick_max(c, offs_e == i1, offs_e, BLOCK_E)
                m1 = m1 + m2
            gscore = tl.where(offs_g == g, m1, gscore)
        chosen = offs_g < 0
        for _ in tl.static_range(TOPK_GROUP):
            _, gi = _pick_max(gscore, chosen | (offs_g >= N_GROUP), offs_g, BLOCK_G)
            chosen = chosen | (offs_g == gi)
        keep = none
        for g in tl.static_range(N_GROUP):
            sel = tl.max(tl.where(chosen & (offs_g == g), 1, 0), 0)
            keep = keep | ((group == g) & (sel > 0))
        choice = tl.where(keep, choice, float("-inf") if GROUP_MODE == 1 else 0.0)
    choice = tl.where(e_ok, choice, float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    picked_i = tl.zeros([BLOCK_K], dtype=tl.int64)
    taken = none | (offs_e >= E)
    for j in tl.static_range(TOP_K):
        _, i = _pick_max(choice, taken, offs_e, BLOCK_E)
        taken = taken | (offs_e == i)
        picked_w = tl.where(offs_k == j, tl.sum(tl.where(offs_e == i, scores, 0.0), 0), picked_w)
        picked_i = tl.where(offs_k == j, i.to(tl.int64), picked_i)
    k_ok = offs_k < TOP_K
    total = tl.sum(tl.where(k_ok, picked_w, 0.0), 0)
    if V2:
        if NORM and TOP_K > 1:
            picked_w = picked_w / (total + 1e-20)
        else:
            picked_w = picked_w * scaling
    else:
        if NORM:
            picked_w = picked_w / (total + 1e-20)
        picked_w = picked_w * scaling
    tl.store(W_OUT + t * TOP_K + offs_k, picked_w, mask=k_ok)
    tl.store(I_OUT + t * TOP_K + offs_k, picked_i, mask=k_ok)


def moe_route_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: RouteSpec
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `moe_route_torch`."""
    T, H = x.shape
    E = weight.shape[0]
    if weight.shape[1] != H or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("router: x [T, H] and weight [E, H] must agree and be contiguous in H")
    if spec.group_mode and E % spec.n_group:
        raise ValueError(f"{E} experts do not split into {spec.n_group} groups")
    if not 1 <= spec.top_k <= E:
        raise ValueError(f"top_k={spec.top_k} must be in 1..{E}")
    weights = torch.empty(T, spec.top_k, dtype=torch.float32, device=x.device)
    idx = torch.empty(T, spec.top_k, dtype=torch.int64, device=x.device)
    if T == 0:
        return weights, idx
    block_e = triton.next_power_of_2(E)
    _moe_route_kernel[(T,)](
        x, weight, bias if bias is not None else weight, weights, idx, H, x.stride(0), weight.stride(0),
        float(spec.scaling),
        E=E, BLOCK_E=block_e, BLOCK_H=max(16, min(triton.next_power_of_2(H), 8192 // block_e)),
        TOP_K=spec.top_k, BLOCK_K=max(2, triton.next_power_of_2(spec.top_k)),
        N_GROUP=spec.n_group, BLOCK_G=max(2, triton.next_power_of_2(spec.n_group)), TOPK_GROUP=spec.topk_group,
        GROUP_MODE=spec.group_mode, SIGMOID=spec.sigmoid, HAS_BIAS=bias is not None, NORM=spec.norm_topk_prob,
        V2=spec.v2, num_warps=4,
    )
    return weights, idx


def moe_route(x, weight, bias, spec: RouteSpec):
    """Triton on CUDA, the torch reference elsewhere."""
    if x.is_cuda:
        return moe_route_triton(x, weight, bias, spec)
    return moe_route_torch(x, weight, bias, spec)


# ---- experts ---------------------------------------------------------------------------------------
def moe_experts_torch(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                      w_down: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                      ) -> torch.Tensor:
    """x [T, H]; idx / weights [T, k]; w_gate_up [E, 2I, H] (gate rows, then up rows), w_down [E, H, I];
    shared = (gate [S·I, H], up [S·I, H], down [H, S·I]) of the shared experts or None →
    Σ_j weights[:, j]·down_e(silu(gate_e x)·up_e x) + shared(x), [T, H] in x's dtype, fp32 inside."""
    I = w_down.shape[2]
    xf = x.float()
    gu = torch.einsum("th,tkrh->tkr", xf, w_gate_up[idx].float())  # [T, k, 2I]
    h = torch.nn.functional.silu(gu[..., :I]) * gu[..., I:]
    out = torch.einsum("tki,tkhi->th", h * weights.float()[..., None], w_down[idx].float())
    if shared is not None:
        g, u, d = (w.float() for w in shared)
        out = out + (torch.nn.functional.silu(xf @ g.T) * (xf @ u.T)) @ d.T
    return out.to(x.dtype)


@triton.jit
def _moe_up_kernel(
    X, IDX, WGU, SG, SU, HBUF, H, I,
    stride_x, stride_we, stride_wr, stride_sr, stride_hb,
    TOP_K: tl.constexpr, N_SHARED: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """One program per (token·slot, BLOCK_I intermediate units): silu(x·Wg)·(x·Wu)."""
    s = tl.program_id(0)
    pid_i = tl.program_id(1)
    t = s // (TOP_K + N_SHARED)
    j = s % (TOP_K + N_SHARED)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = offs_i < I
    if j < TOP_K:  # a routed expert: gate rows then up rows of w_gate_up[e]
        e = tl.load(IDX + t * TOP_K + j)
        g_rows = WGU + e * stride_we + offs_i * stride_wr
        u_rows = g_rows + I * stride_wr
    else:  # shared pseudo-expert c: rows c·I.. of the shared gate and up weights
        c = j - TOP_K
        g_rows = SG + (c * I + offs_i) * stride_sr
        u_rows = SU + (c * I + offs_i) * stride_sr
    acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        x = tl.load(X + t * stride_x + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        m = i_ok[:, None] & h_ok[None, :]
        wg = tl.load(g_rows[:, None] + offs_h[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(u_rows[:, None] + offs_h[None, :], mask=m, other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * x[None, :], 1)
        acc_u += tl.sum(wu * x[None, :], 1)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(HBUF + s * stride_hb + offs_i, h, mask=i_ok)


@triton.jit
def _moe_down_kernel(
    HBUF, IDX, WTS, WD, SD, OUT, H, I,
    stride_hb, stride_de, stride_dr, stride_sdr, stride_o,
    TOP_K: tl.constexpr, N_SHARED: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """One program per (token, BLOCK_O output columns): Σ over the token's slots of weight · Wd·h."""
    t = tl.program_id(0)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = offs_o < H
    acc = tl.zeros([BLOCK_O], dtype=tl.float32)
    for j in tl.static_range(TOP_K + N_SHARED):
        if j < TOP_K:
            e = tl.load(IDX + t * TOP_K + j)
            w = tl.load(WTS + t * TOP_K + j).to(tl.float32)
            rows = WD + e * stride_de + offs_o * stride_dr
        else:
            w = 1.0
            rows = SD + offs_o * stride_sdr + (j - TOP_K) * I
        part = tl.zeros([BLOCK_O], dtype=tl.float32)
        for i0 in range(0, I, BLOCK_I):
            offs_i = i0 + tl.arange(0, BLOCK_I)
            i_ok = offs_i < I
            h = tl.load(HBUF + (t * (TOP_K + N_SHARED) + j) * stride_hb + offs_i, mask=i_ok, other=0.0)
            wd = tl.load(rows[:, None] + offs_i[None, :], mask=o_ok[:, None] & i_ok[None, :], other=0.0)
            part += tl.sum(wd.to(tl.float32) * h[None, :], 1)
        acc += w * part
    tl.store(OUT + t * stride_o + offs_o, acc.to(OUT.dtype.element_ty), mask=o_ok)


def moe_experts_triton(x, idx, weights, w_gate_up, w_down, shared=None):
    """Same contract as `moe_experts_torch`: two launches whatever the expert count."""
    T, H = x.shape
    E, two_i, Hw = w_gate_up.shape
    I = w_down.shape[2]
    if Hw != H or two_i != 2 * I or w_down.shape[:2] != (E, H) or idx.shape != weights.shape:
        raise ValueError("moe_experts: x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], idx/weights [T, k]")
    for w in (x, w_gate_up, w_down, *(shared or ())):
        if w.stride(-1) != 1:
            raise ValueError("moe_experts: weights and x must be contiguous in their last dimension")
    n_shared = 0
    sg = su = sd = w_gate_up
    if shared is not None:
        sg, su, sd = shared
        if sg.shape[0] % I or sg.shape != su.shape or sd.shape != (H, sg.shape[0]) or sg.shape[1] != H:
            raise ValueError("shared experts must be (gate [S·I, H], up [S·I, H], down [H, S·I])")
        n_shared = sg.shape[0] // I
        if sg.stride(0) != su.stride(0):
            raise ValueError("shared gate and up must share a row stride")
    k = idx.shape[1]
    slots = k + n_shared
    out = torch.empty_like(x)
    if T == 0:
        return out
    hbuf = torch.empty(T * slots, I, dtype=torch.float32, device=x.device)
    idx = idx.contiguous()
    weights = weights.contiguous()
    block_i = 32
    _moe_up_kernel[(T * slots, triton.cdiv(I, block_i))](
        x, idx, w_gate_up, sg, su, hbuf, H, I,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), sg.stride(0), hbuf.stride(0),
        TOP_K=k, N_SHARED=n_shared, BLOCK_I=block_i, BLOCK_H=min(256, triton.next_power_of_2(H)), num_warps=4,
    )
    block_o = 32
    _moe_down_kernel[(T, triton.cdiv(H, block_o))](
        hbuf, idx, weights, w_down, sd, out, H, I,
        hbuf.stride(0), w_down.stride(0), w_down.stride(1), sd.stride(0), out.stride(0),
        TOP_K=k, N_SHARED=n_shared, BLOCK_O=block_o, BLOCK_I=min(256, triton.next_power_of_2(I)), num_warps=4,
    )
    return out
