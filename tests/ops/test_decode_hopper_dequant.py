"""The Hopper kernel that dequantises fp8_ds_mla / tbq4 blocks into bf16 tiles (`ops.decode.hopper.dequant`): against
the fp32 reference on the dequantised rows with NaN-poisoned tails and permuted tables (the Triton kernel on the same
call agrees too), and (with the fp8 and dequant_seesaw kernels) on a cache full of zero and subnormal fp8 codes.
GPU (Hopper) only; on the CPU an sm_90 compile."""

import pytest
import torch
from helpers.mla_cases import rel_err
from helpers.offline_compile import offline_sm90_rows
from helpers.decode_kernels import hopper, poisoned_case, run_kernel

from specmla.ops.decode import mla_decode
from specmla.ops.decode.hopper import dequant as F
from specmla.ops.decode.hopper import dequant_seesaw as D
from specmla.ops.decode.hopper import fp8 as R
from specmla.ops.kv_cache import row_spec, write_kv_cache


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "tbq4"])
@pytest.mark.parametrize("H,S,page,lens,splits,causal", [
    (16, 1, 64, [333, 1, 64, 65, 200], None, True),  # H=16: 16 rows
    (16, 2, 16, [700, 129, 5], 3, True),  # two tokens folded: 32 rows
    (8, 1, 64, [1000, 3], 1, False),  # one split, written directly; 8 heads padded to 16 rows
    (16, 1, 32, [1, 2, 63, 127, 128, 129, 4096], 7, True),  # lengths around key blocks (64 and 128), many splits
    (3, 2, 1, [70, 9], 2, True),  # one-token pages, odd head count
])
def test_dequant_kernel_matches_the_reference(fmt, H, S, page, lens, splits, causal):
    """Codes unpacked exactly into a shared-memory tile, fp8 scales / tbq4 norms folded into the scores and P, keys
    as M; tbq4 in the rotated domain. The Triton kernel on the same call agrees too."""
    q, cache, table, seq, want, want_lse = poisoned_case(fmt, H * 7 + S + page, lens, S, H, page, causal)
    args = (q.bfloat16().cuda(), cache.cuda(), table.cuda(), seq.cuda(), 0.0721)
    seen = torch.isfinite(want_lse)
    runs = {"gluon": run_kernel(F, *args, kv_format=fmt, causal=causal, num_splits=splits, max_rows=32,
                                return_lse=True),
            "triton": mla_decode(*args, head_dim_v=512, kv_format=fmt, causal=causal, return_lse=True,
                                 num_splits=splits, backend="triton")}
    for name, (got, got_lse) in runs.items():
        got, got_lse = got.float().cpu(), got_lse.cpu()
        assert not got.isnan().any()
        assert rel_err(got, want) < 1e-2, name
        assert torch.equal(torch.isfinite(got_lse), seen)
        # keys reach the dots rounded to bf16 (the Triton kernel: code·scale or centroid·norm; the Gluon
        # kernel: tbq4 centroids, 2⁻⁹ relative): scores of magnitude ~10 here move the lse by up to ~1e-2,
        # where a bf16 cache's stays under 1e-3
        assert (got_lse[seen] - want_lse[seen]).abs().max() < 2e-2, name


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("module,fmt,S,rows", [(F, "fp8_ds_mla", 1, 16), (R, "fp8_ds_mla", 1, 16), (D, "fp8", 4, 64)],
                         ids=["dequant", "fp8", "dequant_seesaw"])
def test_fp8_kernels_with_zero_and_subnormal_codes(module, fmt, S, rows):
    """dequant turns codes into bf16 with integer operations, exactly for normal codes; zeros and subnormal codes
    (|code| < 2⁻⁶) come out within 2⁻⁷ of their value in code units. dequant_seesaw converts every code exactly to
    fp16 (`cvt.rn.f16x2.e4m3x2`). The fp8 kernel multiplies the codes themselves. A cache whose chunks span six
    decades holds many of them; the output still matches the reference on the dequantised rows."""
    g = torch.Generator().manual_seed(11)
    B, H, T, page = 3, 16, 700, 64
    c_kv = torch.randn(B * T, 512, generator=g) * 10.0 ** (-6 * torch.rand(B * T, 512, generator=g))
    c_kv[:, ::7] = 0.0
    k_pe = torch.randn(B * T, 64, generator=g)
    pages = B * (-(-T // page))
    cache = torch.zeros(pages, page, row_spec(fmt, 512, 64, torch.float32)[0], dtype=torch.uint8)
    table = torch.randperm(pages, generator=g).view(B, -1).to(torch.int32)
    slots = torch.cat([(table[b].long()[:, None] * page + torch.arange(page)).flatten()[:T] for b in range(B)])
    write_kv_cache(cache, c_kv, k_pe, slots, fmt)
    codes = cache.view(-1, cache.shape[-1])[slots, :512]
    assert ((codes & 0x78) == 0).float().mean() > 0.2  # zero or subnormal codes: exponent bits 0
    q = torch.randn(B, S, H, 576, generator=g)
    seq = torch.full((B,), T, dtype=torch.int32)
    want = mla_decode(q, cache, table, seq, 0.0721, backend="torch", head_dim_v=512, kv_format=fmt)
    got = run_kernel(module, q.bfloat16().cuda(), cache.cuda(), table.cuda(), seq.cuda(), 0.0721, kv_format=fmt,
                     max_rows=rows)
    assert rel_err(got.float().cpu(), want) < 1e-2


def test_dequant_kernel_compiles_for_sm90():
    """CPU: the kernel compiles for sm_90 at 16 rows (direct) and 32 rows (split) on both row formats, its two
    consumer warpgroups and 8-warp producer within the register file (no local memory) and an H100's shared
    memory."""
    cases = [[16, 1, 512, 64, "fp8_ds_mla", True], [16, 2, 512, 64, "fp8_ds_mla", False],
             [16, 1, 512, 64, "tbq4", False], [32, 1, 512, 64, "tbq4", False]]
    for row in offline_sm90_rows(cases):
        (k,) = row["kernels"]
        assert k["name"] == "_mla_decode_quant_kernel" and k["warps"] == 16, row
        assert 0 < k["regs"] <= 255 and k["local"] == 0 and k["stack"] <= 256 and k["shared"] <= 227 * 1024, row
