"""Torch reference of MLA prefill attention over ragged packs (contract C2)."""

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
            rows = torch.arange(lq, device=q.device)[:, None]
            allowed = torch.arange(lk, device=q.device)[None, :] <= rows + lk - lq
            s = s.masked_fill(~allowed[None], float("-inf"))
        l = torch.logsumexp(s, dim=-1)  # [H, lq]
        p = torch.exp(s - l.masked_fill(torch.isinf(l), 0.0)[..., None])
        o[q0:q1] = torch.einsum("hqk,khd->qhd", p, vi).to(o.dtype)
        lse[q0:q1] = l.transpose(0, 1).float()
    return (o, lse) if return_lse else o
