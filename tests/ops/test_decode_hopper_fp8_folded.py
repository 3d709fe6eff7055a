"""The Hopper kernel that runs Q·Kᵀ as e4m3 matmuls on fp8 / fp8_ds_mla codes (tbq4: decoded to e4m3) for up to 64
query rows
(`ops.decode.hopper.fp8_folded`): against the fp32 reference on the dequantised rows and against a torch emulation
of its own rounding (`tile_reference.mla_decode_tiles(e4m3_scores=True)`), with NaN-poisoned tails and permuted
tables, S > 1 tokens folded into one program, odd block counts, one-block and empty splits, in a CUDA graph. GPU
(Hopper) only; on the CPU an sm_90 compile."""

import pytest
import torch
from helpers.decode_kernels import hopper, poisoned_case, quant_case, run_kernel
from helpers.mla_cases import rel_err
from helpers.offline_compile import offline_sm90_rows

from specmla.ops.decode import mla_decode
from specmla.ops.decode.hopper import fp8_folded as K
from specmla.ops.decode.hopper.tile_reference import mla_decode_tiles


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla", "tbq4"])
@pytest.mark.parametrize("H,S,page,lens,splits,causal", [
    (16, 4, 64, [333, 1, 64, 65, 200], None, True),  # four tokens × 16 heads: 64 rows; a request shorter than S
    (16, 3, 64, [700, 129, 5], 3, True),  # three tokens: 48 rows padded to 64
    (64, 1, 64, [1000, 3], 1, False),  # 64 heads, one split written directly
    (32, 2, 128, [1, 2, 63, 127, 128, 129, 4096], 7, True),  # lengths around blocks and rounds (64, 128)
    (7, 8, 64, [70, 9], 2, True),  # odd head count: eight tokens × 8-head blocks, 56 of 64 rows
    (21, 3, 64, [70, 9], 2, True),  # 21 heads in 32-row tiles, one token per program
    (16, 4, 64, [130], 16, True),  # more splits than blocks: empty splits
    (16, 2, 64, [64 * 9], 1, True),  # nine blocks, one split: an odd last round
])
def test_fp8_folded_matches_the_reference(fmt, H, S, page, lens, splits, causal):
    """Outputs within 6e-2 of the exact reference and 2e-3 of the emulation of the kernel's rounding (q in one e4m3
    term against the codes, chunk partials times the fp32 scales; P and code · scale in fp16); the lse too."""
    q, cache, table, seq, want, want_lse = poisoned_case(fmt, H * 11 + S + page, lens, S, H, page, causal)
    args = (q.bfloat16().cuda(), cache.cuda(), table.cuda(), seq.cuda(), 0.0721)
    got, got_lse = run_kernel(K, *args, kv_format=fmt, causal=causal, num_splits=splits, max_rows=64,
                              return_lse=True)
    got, got_lse = got.float().cpu(), got_lse.cpu()
    seen = torch.isfinite(want_lse)
    assert not got.isnan().any()
    # q rounded to one e4m3 term moves random scores by ~2⁻⁴ of their spread: 1.7–3.6 % here; tbq4's e4m3 centroids
    # are within 2 % of the exact ones
    assert rel_err(got, want) < 6e-2
    assert torch.equal(torch.isfinite(got_lse), seen)
    assert (got[~seen].abs() == 0).all()  # rows that see no key (causal, before the request's first) are zeros
    emul, emul_lse = mla_decode_tiles(q.bfloat16().float(), cache, table, seq, 0.0721, causal=causal, kv_format=fmt,
                                      head_dim_v=512, return_lse=True, e4m3_scores=True)
    # both rounded to bf16 (2⁻⁹ relative): the rest is the fp8 tensor cores' accumulation and the summation order;
    # tbq4's output is rounded twice (in the rotated domain, then after the rotation back): 2.5–2.6e-3 from that alone
    assert rel_err(got, emul.bfloat16().float()) < (4e-3 if fmt == "tbq4" else 2e-3)
    assert (got_lse[seen] - emul_lse[seen]).abs().max() < 5e-3
    assert (got_lse[seen] - want_lse[seen]).abs().max() < 3e-1


def test_fp8_folded_compiles_for_sm90():
    """CPU: the kernel compiles for sm_90 on both row formats, direct and split, its two consumer warpgroups and
    loader warp within the register file and an H100's shared memory."""
    cases = [[16, 4, 512, 64, "folded_fp8", False], [16, 4, 512, 64, "folded_fp8_ds_mla", True],
             [16, 4, 512, 64, "folded_tbq4", False], [16, 3, 512, 64, "folded_tbq4", True]]
    for row in offline_sm90_rows(cases):
        (k,) = row["kernels"]
        assert k["name"] == "_mla_decode_fp8_folded_kernel", row
        assert 0 < k["regs"] <= 255 and k["local"] == 0 and k["shared"] <= 227 * 1024, row
        assert not k["wgmma_serialized"], row  # the P·V warpgroups need 176 registers or more for it


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla", "tbq4"])
def test_fp8_folded_in_a_cuda_graph(fmt):
    """Captured once (S = 4 tokens folded, a preallocated workspace), replayed with new lengths and queries: every
    replay matches the reference (nothing depends on host-side lengths)."""
    from specmla.ops.decode import mla_decode_torch

    B, S, H, T = 4, 4, 16, 700
    q, cache, table = quant_case(fmt, seed=5, B=B, S=S, H=H, T=T, page=64)
    q, cache, table = q.bfloat16().cuda(), cache.cuda(), table.cuda()
    seq = torch.full((B,), T, dtype=torch.int32, device="cuda")
    ns = 3
    ws = (torch.empty(B, S, H, ns, 512, device="cuda"), torch.empty(B, S, H, ns, device="cuda"))
    out = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
    mla_decode(q, cache, table, seq, 0.0721, out=out, workspace=ws, kv_format=fmt, opts=K.Options())  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q, cache, table, seq, 0.0721, out=out, workspace=ws, kv_format=fmt, opts=K.Options())
    g = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(3):
        seq.copy_(torch.randint(S, T + 1, (B,), dtype=torch.int32, device="cuda", generator=g))
        q.copy_(torch.randn(q.shape, device="cuda", generator=g))
        graph.replay()
        want = mla_decode_torch(q.double(), cache, table, seq, 0.0721, head_dim_v=512, kv_format=fmt)
        assert rel_err(out.double(), want) < 6e-2  # one e4m3 term: 3.4 %
