"""MLA prefill attention in its MHA form over ragged packs (contract C2).

q [Σq, H, Dqk], k [Σkv, H, Dqk], v [Σkv, H, Dv]; request i owns q rows cu_q[i]:cu_q[i+1] and kv
rows cu_kv[i]:cu_kv[i+1]. Causal masking is bottom-right aligned: when q_len < kv_len (a prefill
chunk after a cached prefix) query t sees kv positions j <= kv_len - q_len + t.

Backends: "torch" (`reference.mla_prefill_torch`), "triton" (`triton.mla_prefill_triton`, portable),
"hopper" (`hopper.mla_prefill_hopper`, the Gluon kernel for Hopper); "auto" takes the Hopper kernel where it
takes the call, else the Triton kernel, on CUDA tensors that need no gradient, and the reference otherwise.

`prefill_schedule` builds the order in which the Hopper kernel runs a ragged batch's row blocks (longest first),
on the device without a host sync; a caller that runs many calls on one batch (every layer of a forward) builds
it once and passes it as `schedule`, else the Hopper kernel builds it on each ragged call.
"""

from __future__ import annotations

import torch

from specmla.ops.backend import pick_backend
from specmla.ops.prefill import hopper
from specmla.ops.prefill.hopper import PrefillSchedule, prefill_schedule
from specmla.ops.prefill.reference import mla_prefill_torch
from specmla.ops.prefill.triton import mla_prefill_triton

BACKENDS = ("auto", "torch", "triton", "hopper")


def _check_args(q, k, v):
    """What the kernels need: q, k, v of one head count and q·k width, contiguous in their last dimension."""
    H, dqk = q.shape[1], q.shape[-1]
    if k.shape[1] != H or v.shape[1] != H or k.shape[-1] != dqk:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together")
    if min(q.stride(-1), k.stride(-1), v.stride(-1)) != 1:
        raise ValueError("q, k, v must be contiguous in their last dimension")


def mla_prefill(
    q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, softmax_scale,
    *, causal: bool = True, return_lse: bool = False, out: torch.Tensor | None = None, backend: str = "auto",
    schedule: PrefillSchedule | None = None,
):
    """Contract C2. Returns out [Σq, H, Dv] (and lse [Σq, H] fp32 when return_lse). `schedule`: this batch's
    `prefill_schedule`, used by the Hopper kernel on ragged batches (others ignore it)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} ({' | '.join(BACKENDS)})")
    auto = backend == "auto"
    if auto:
        backend = pick_backend("auto", q, k, v)
    if backend == "torch":
        return mla_prefill_torch(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, softmax_scale,
                                 causal=causal, return_lse=return_lse, out=out)
    _check_args(q, k, v)
    if backend == "hopper" or auto:
        if hopper.supported(q, k, v, softmax_scale):
            return hopper.mla_prefill_hopper(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                                             softmax_scale, causal=causal, return_lse=return_lse, out=out,
                                             schedule=schedule)
        if backend == "hopper":
            raise ValueError("the Hopper prefill kernel does not take this call (Hopper, bf16/fp16, heads packed "
                             "in TMA-aligned rows, power-of-two head dims that fit shared memory)")
    return mla_prefill_triton(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, softmax_scale,
                              causal=causal, return_lse=return_lse, out=out)


__all__ = ["PrefillSchedule", "mla_prefill", "mla_prefill_torch", "mla_prefill_triton", "prefill_schedule"]
