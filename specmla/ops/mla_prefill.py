"""MLA prefill attention in its MHA form over ragged packs (contract C2), torch reference.

q [Σq, H, Dqk], k [Σkv, H, Dqk], v [Σkv, H, Dv]; request i owns q rows cu_q[i]:cu_q[i+1] and kv
rows cu_kv[i]:cu_kv[i+1]. Causal masking is bottom-right aligned: when q_len < kv_len (a prefill
chunk after a cached prefix) query t sees kv positions j <= kv_len - q_len + t.
"""

from __future__ import annotations

import torch


def mla_prefill_torch(
    q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, softmax_scale,
    *, causal: bool = True, return_lse: bool = False, out: torch.Tensor | None = None,
):
    """Reference: one SDPA-style computation per request, fp32 softmax (fp64 for fp64 inputs)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    H, Dv = q.shape[1], v.shape[-1]
    o = out if out is not None else q.new_empty(q.shape[0], H, Dv)
    lse = torch.full((q.shape[0], H), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ckv = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
    for i in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[i], cq[i + 1], ckv[i], ckv[i + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        if lk == 0:
            o[q0:q1] = 0
            continue
        qi, ki, vi = q[q0:q1].to(acc), k[k0:k1].to(acc), v[k0:k1].to(acc)
        s = torch.einsum("qhd,khd->hqk", qi, ki) * softmax_scale
        if causal:
            allowed = torch.arange(lk, device=q.device)[None, :] <= (torch.arange(lq, device=q.device)[:, None] + lk - lq)
            s = s.masked_fill(~allowed[None], float("-inf"))
        l = torch.logsumexp(s, dim=-1)  # [H, lq]
        p = torch.exp(s - l.masked_fill(torch.isinf(l), 0.0)[..., None])
        o[q0:q1] = torch.einsum("hqk,khd->qhd", p, vi).to(o.dtype)
        lse[q0:q1] = l.transpose(0, 1).float()
    return (o, lse) if return_lse else o


def mla_prefill(
    q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, softmax_scale,
    *, causal: bool = True, return_lse: bool = False, out: torch.Tensor | None = None, backend: str = "auto",
):
    """Contract C2. Returns out [Σq, H, Dv] (and lse [Σq, H] fp32 when return_lse)."""
    if backend in ("auto", "torch"):
        return mla_prefill_torch(
            q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, softmax_scale,
            causal=causal, return_lse=return_lse, out=out,
        )
    if backend == "triton":
        raise NotImplementedError("the Triton MLA prefill kernel is not built yet; use backend='torch'")
    raise ValueError(f"unknown backend {backend!r} (auto | triton | torch)")
