"""Triton varlen prefill (contract C2) vs the fp64 reference: ragged batches, prefixes, empty requests."""

import pytest
import torch
from mla_cases import rel_err

from specmla.ops.mla_prefill import mla_prefill, mla_prefill_torch


def ragged(q_lens, kv_lens, H, dqk, dv, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + kv_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), H, dqk, generator=g)
    k = torch.randn(sum(kv_lens), H, dqk, generator=g)
    v = torch.randn(sum(kv_lens), H, dv, generator=g)
    return [t.to(dtype).to(device) for t in (q, k, v)] + [cu_q.to(device), cu_k.to(device)]


CASES = [  # q_lens, kv_lens, H, dqk, dv
    ([5, 1, 17], [5, 1, 17], 2, 192, 128),  # plain prefill, DeepSeek head dims
    ([3, 0, 9, 1], [10, 4, 9, 70], 3, 64, 32),  # prefixes (q_len < kv_len) and an empty request
    ([33], [100], 1, 48, 24),  # odd head dims (not powers of two)
    ([70, 2], [70, 2], 4, 32, 32),  # longer than one block
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_prefill_matches_reference(case, causal, dtype):
    q_lens, kv_lens, H, dqk, dv = case
    q, k, v, cu_q, cu_k = ragged(q_lens, kv_lens, H, dqk, dv, dtype, seed=len(q_lens))
    want, want_lse = mla_prefill_torch(q.double(), k.double(), v.double(), cu_q, cu_k, max(q_lens), max(kv_lens),
                                       0.11, causal=causal, return_lse=True)
    got, got_lse = mla_prefill(q, k, v, cu_q, cu_k, max(q_lens), max(kv_lens), 0.11, causal=causal,
                               return_lse=True, backend="triton")
    assert got.dtype == dtype and not torch.isnan(got).any()
    assert rel_err(got, want) <= (1e-4 if dtype == torch.float32 else 1e-2)
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(got_lse))
    assert (got_lse[fin].double() - want_lse[fin]).abs().max() <= 1e-3


def test_bad_shapes_raise():
    q, k, v, cu_q, cu_k = ragged([3], [3], 2, 32, 16, torch.float32)
    with pytest.raises(ValueError):
        mla_prefill(q, k[:, :1], v, cu_q, cu_k, 3, 3, 0.1, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 128])
def test_gpu_prefill_bf16_ragged(H):
    q_lens = [1, 128, 777, 4096, 3000, 0, 2048]
    kv_lens = [1, 300, 777, 4096, 5000, 64, 8192]
    q, k, v, cu_q, cu_k = ragged(q_lens, kv_lens, H, 192, 128, torch.bfloat16, device="cuda")
    # fp32 reference on the GPU from the same bf16 values (an fp64 CPU reference at H=128 takes minutes)
    want, want_lse = mla_prefill_torch(q.float(), k.float(), v.float(), cu_q, cu_k, max(q_lens), max(kv_lens), 0.07,
                                       return_lse=True)
    got, lse = mla_prefill(q, k, v, cu_q, cu_k, max(q_lens), max(kv_lens), 0.07, return_lse=True)
    assert rel_err(got.float(), want) <= 1e-2
    assert (lse - want_lse).abs().max().item() <= 1e-3
