"""The Hopper kernel that dequantises fp8 / fp8_ds_mla / tbq4 blocks once into fp16 tiles for 64 query rows
(`ops.decode.hopper.dequant_seesaw`): against the fp32 reference on the dequantised rows with NaN-poisoned tails
and permuted tables, S > 1 tokens folded into one program, odd block counts, one-token pages and empty splits (its
zero and subnormal codes: `test_decode_hopper_dequant`). GPU (Hopper) only; on the CPU an sm_90 compile."""

import pytest
import torch
from helpers.decode_kernels import hopper, poisoned_case, quant_case, run_kernel
from helpers.mla_cases import rel_err
from helpers.offline_compile import offline_sm90_rows

from specmla.ops.decode import mla_decode
from specmla.ops.decode.hopper import dequant_seesaw as D
from specmla.ops.decode.hopper.tile_reference import mla_decode_tiles


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla", "tbq4"])
@pytest.mark.parametrize("H,S,page,lens,splits,causal", [
    (16, 4, 64, [333, 1, 64, 65, 200], None, True),  # four tokens × 16 heads: 64 rows; a request shorter than S
    (16, 3, 16, [700, 129, 5], 3, True),  # three tokens: 48 rows padded to 64
    (64, 1, 64, [1000, 3], 1, False),  # 64 heads, one split written directly
    (32, 2, 32, [1, 2, 63, 127, 128, 129, 4096], 7, True),  # lengths around blocks and rounds (64, 128), many splits
    (7, 8, 1, [70, 9], 2, True),  # one-token pages, odd head count: eight tokens × 8-head blocks, 56 of 64 rows
    (21, 3, 16, [70, 9], 2, True),  # 21 heads in 32-row tiles, one token per program
    (16, 4, 64, [130], 16, True),  # more splits than blocks: empty splits
])
def test_dequant_seesaw_matches_the_reference(fmt, H, S, page, lens, splits, causal):
    """Codes · scales (tbq4: centroids · norms, in the rotated domain) rounded to fp16 once per block; the seesaw's
    two warpgroups on the tiles. The lse must match too (the combine of splits depends on it)."""
    q, cache, table, seq, want, want_lse = poisoned_case(fmt, H * 7 + S + page, lens, S, H, page, causal)
    args = (q.bfloat16().cuda(), cache.cuda(), table.cuda(), seq.cuda(), 0.0721)
    got, got_lse = run_kernel(D, *args, kv_format=fmt, causal=causal, num_splits=splits, max_rows=64, return_lse=True)
    got, got_lse = got.float().cpu(), got_lse.cpu()
    seen = torch.isfinite(want_lse)
    assert not got.isnan().any()
    assert rel_err(got, want) < 1e-2
    assert torch.equal(torch.isfinite(got_lse), seen)
    assert (got[~seen].abs() == 0).all()  # rows that see no key (causal, before the request's first) are zeros
    # the lse against the emulation of the kernel's own rounding (keys' latent part in fp16 tiles, fp32 scores): only
    # the summation order differs. Against the exact reads the keys' rounding moves scores of ~10 by ~1e-2.
    _, tile_lse = mla_decode_tiles(q.bfloat16().float(), cache, table, seq, 0.0721, causal=causal, kv_format=fmt,
                                   head_dim_v=512, return_lse=True)
    assert torch.equal(torch.isfinite(tile_lse), seen)
    assert (got_lse[seen] - tile_lse[seen]).abs().max() < 2e-3
    assert (got_lse[seen] - want_lse[seen]).abs().max() < 5e-2


def test_dequant_seesaw_compiles_for_sm90():
    """CPU: the kernel compiles for sm_90 on the three row formats, direct and split, its two consumer warpgroups and
    4-warp producer within the register file (no local memory) and an H100's shared memory."""
    cases = [[16, 4, 512, 64, "seesaw_fp8", False], [16, 4, 512, 64, "seesaw_fp8_ds_mla", True],
             [64, 1, 512, 64, "seesaw_tbq4", False]]
    for row in offline_sm90_rows(cases):
        (k,) = row["kernels"]
        assert k["name"] == "_mla_decode_dequant_seesaw_kernel" and k["warps"] == 12, row
        assert 0 < k["regs"] <= 255 and k["local"] == 0 and k["stack"] <= 640 and k["shared"] <= 227 * 1024, row
        assert not k["wgmma_serialized"], row


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("fmt", ["fp8", "tbq4"])
def test_dequant_seesaw_in_a_cuda_graph(fmt):
    """Captured once (S = 4 tokens folded, a preallocated workspace), replayed with new lengths and queries: every
    replay matches the reference (nothing depends on host-side lengths)."""
    from specmla.ops.decode import mla_decode_torch

    B, S, H, T = 4, 4, 16, 700
    q, cache, table = quant_case(fmt, seed=5, B=B, S=S, H=H, T=T, page=64)
    q, cache, table = q.bfloat16().cuda(), cache.cuda(), table.cuda()
    seq = torch.full((B,), T, dtype=torch.int32, device="cuda")
    opts = D.Options()
    ns = 3
    ws = (torch.empty(B, S, H, ns, 512, device="cuda"), torch.empty(B, S, H, ns, device="cuda"))
    out = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
    mla_decode(q, cache, table, seq, 0.0721, out=out, workspace=ws, kv_format=fmt, opts=opts)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q, cache, table, seq, 0.0721, out=out, workspace=ws, kv_format=fmt, opts=opts)
    g = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(3):
        seq.copy_(torch.randint(S, T + 1, (B,), dtype=torch.int32, device="cuda", generator=g))
        q.copy_(torch.randn(q.shape, device="cuda", generator=g))
        graph.replay()
        want = mla_decode_torch(q.double(), cache, table, seq, 0.0721, head_dim_v=512, kv_format=fmt)
        assert rel_err(out.double(), want) < 1e-2
