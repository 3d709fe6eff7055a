"""The tbq4 decode kernel (`ops.decode.hopper.tbq4`), which decodes codes into e4m3 for the e4m3 consumers: the
whole kernel against the fp64 tbq4 reference on ragged lengths (one key block, an odd block per consumer, many
blocks, several splits, several query tokens) with 0xFF bytes (NaN norms and rope) past each request's end, its
options against its default, and the calls it leaves to the other kernels. GPU (Hopper) only; on the CPU: its
byte-permute lookup, emulated, against the centroid table, and an sm_90 compile."""

import random

import pytest
import torch
from helpers.offline_compile import offline_sm90_rows
from helpers.decode_kernels import assert_tokens_match, hopper, quant_problem, run_kernel

from specmla.ops.decode.hopper import tbq4 as T
from specmla.ops.kv_cache import tbq4

SCALE = 576 ** -0.5


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens,splits", [([1, 63, 64, 65, 300, 1000], None), ([4097, 77, 128], 1),
                                         ([4097, 77, 128], 3), ([130, 2], 1), ([8192, 5000], 2)])
def test_tbq4_kernel_matches_the_reference(lens, splits):
    from specmla.ops.decode import mla_decode_torch

    q, cache, table, seq = quant_problem(lens, 1, kv_format="tbq4")
    ref = mla_decode_torch(q.double(), cache, table, seq, SCALE, head_dim_v=512, kv_format="tbq4")
    got = run_kernel(T, q, cache, table, seq, kv_format="tbq4", num_splits=splits).double()
    assert torch.isfinite(got).all()
    # e4m3 centroids (≤ 2 %), q and P in one e4m3 term each: a few per cent against the exact tbq4 attention,
    # small beside the 4-bit codes' own error
    err = ((got - ref).norm() / ref.norm()).item()
    cos = torch.nn.functional.cosine_similarity(got.flatten(2), ref.flatten(2), dim=-1)
    print(f"relative error {err:.4f}, worst row cosine {cos.min().item():.5f}")
    assert err < 5e-2
    assert cos.min().item() > 0.998


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens,splits,opts", [([4097, 77, 128], 3, T.Options(code_box=16)),
                                              ([4097, 77, 128], 3, T.Options(code_box=32)),
                                              ([1, 63, 64, 65, 300, 1000], None, T.Options(num_raw=4)),
                                              ([4097, 77, 128], 3, T.Options(num_raw=4))])
def test_tbq4_options_do_not_change_the_result(lens, splits, opts):
    """Code boxes of one or two chunks' codes per TMA copy land the same words as the default whole-row box; a fourth
    raw stage changes only when copies start: bit for bit the default's result."""
    q, cache, table, seq = quant_problem(lens, 1, kv_format="tbq4")
    want = run_kernel(T, q, cache, table, seq, kv_format="tbq4", num_splits=splits)
    got = run_kernel(T, q, cache, table, seq, kv_format="tbq4", num_splits=splits, opts=opts)
    assert torch.equal(got, want)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens,S,splits", [([700, 90, 3], 2, None), ([4097, 77], 3, 2), ([1, 64, 300], 4, None)])
def test_tbq4_kernel_takes_several_query_tokens_one_per_program(lens, S, splits):
    """S > 1 query tokens (H = 16): one token's 16 rows per program (no folding), each with its own causal limit;
    against the fp64 tbq4 reference, 0xFF bytes past each request's end, a token that sees no key (length 1)."""
    from specmla.ops.decode import mla_decode_torch

    q, cache, table, seq = quant_problem(lens, S, kv_format="tbq4")
    ref = mla_decode_torch(q.double(), cache, table, seq, SCALE, head_dim_v=512, kv_format="tbq4")
    got = run_kernel(T, q, cache, table, seq, kv_format="tbq4", num_splits=splits)
    assert_tokens_match(got, ref, lens, S, max_err=5e-2, min_cos=0.998)


@pytest.mark.gpu
@hopper
def test_tbq4_kernel_leaves_32_row_calls_to_the_other_kernels():
    """32 heads make 32 rows: not this kernel's; the default route still matches the reference."""
    from specmla.ops.decode import mla_decode, mla_decode_torch, route

    q, cache, table, seq = quant_problem([700, 90], 1, H=32, kv_format="tbq4")
    assert not T.supported(q, cache, "tbq4", 32)
    assert T.supported(q[:, :, :16].contiguous(), cache, "tbq4", 16)
    assert route(q, cache, table, kv_format="tbq4", backend="hopper").kernel == "dequant"
    got = mla_decode(q, cache, table, seq, SCALE, head_dim_v=512, kv_format="tbq4", backend="hopper")
    ref = mla_decode_torch(q.double(), cache, table, seq, SCALE, head_dim_v=512, kv_format="tbq4")
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode) in Python: byte i of the result is byte (nibble i of sel) of b:a, or that
    byte's sign replicated when the nibble's top bit is set."""
    pool = (a | b << 32).to_bytes(8, "little")
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 15
        byte = pool[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def test_e4m3_lookup_gives_every_codes_centroid():
    """CPU: the PTX of `tbq4.e4m3_lookup_ptx`, run instruction by instruction in Python on random words (and the
    all-0 / all-15 ones), gives each code's e4m3 entry in coordinate order; the entries are the centroids · k within
    2 %, in code order (8·sign + magnitude rank: the negative codes are the positive ones with the sign bit)."""
    k, codes = tbq4.e4m3_centroids()
    cent = torch.tensor(tbq4.code_centroids(), dtype=torch.float64)
    values = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).double() / k
    assert ((values - cent) / cent).abs().max().item() < 0.02
    assert list(codes[8:]) == [x | 0x80 for x in codes[:8]] and (cent[:8] > 0).all()
    lines = [ln.strip().rstrip(";") for ln in tbq4.e4m3_lookup_ptx().splitlines()]
    rng = random.Random(0)
    for word in [0, 0xFFFFFFFF, 0x76543210, 0xFEDCBA98] + [rng.getrandbits(32) for _ in range(200)]:
        regs = {"$2": word}
        for ln in lines:
            if not ln or ln[0] in "{}." or ln.startswith(".reg"):
                continue
            op, rest = ln.split(None, 1)
            args = [x.strip() for x in rest.split(",")]
            val = [regs[x] if x in regs else int(x, 0) for x in args[1:]]
            if op == "mov.b32":
                r = val[0]
            elif op == "and.b32":
                r = val[0] & val[1]
            elif op == "or.b32":
                r = val[0] | val[1]
            elif op == "shr.u32":
                r = val[0] >> val[1]
            elif op == "shl.b32":
                r = val[0] << val[1]
            elif op == "lop3.b32":  # bit i of the result: bit (a_i·4 + b_i·2 + c_i) of the table
                a, b, c, lut = val
                r = sum(((lut >> ((a >> i & 1) * 4 + (b >> i & 1) * 2 + (c >> i & 1))) & 1) << i for i in range(32))
            elif op == "prmt.b32":
                r = _prmt(*val)
            else:
                raise AssertionError(f"unexpected instruction {op}")
            regs[args[0]] = r & 0xFFFFFFFF
        got = list((regs["$0"] | regs["$1"] << 32).to_bytes(8, "little"))
        assert got == [codes[(word >> (4 * i)) & 15] for i in range(8)], hex(word)


def test_tbq4_kernel_compiles_for_sm90():
    """CPU: the kernel compiles for sm_90 and fits the shared memory, also with 4 raw stages."""
    for row in offline_sm90_rows([[16, 1, 512, 64, "e4m3_tbq4", False], [16, 1, 512, 64, "e4m3_tbq4", True],
                                  [16, 1, 512, 64, "e4m3_tbq4", False, 64, {"num_raw": 4}]]):
        (k,) = row["kernels"]
        assert k["name"] == "_mla_decode_tbq4_kernel" and k["shared"] <= 232448 and k["regs"] > 0
        assert not k["wgmma_serialized"], row


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("H,S,lens", [(4, 4, [3000, 1, 64, 65, 700]), (8, 2, [1000, 129])])
def test_tbq4_kernel_folds_tokens_whose_rows_fit_16(H, S, lens):
    """S · H ≤ 16: the default route folds the tokens into this kernel's own 16 rows; against the fp64 reference with
    NaN bytes past each request's end (q and P in one e4m3 term each: measured 3.8–4.8e-2)."""
    from helpers.decode_kernels import poisoned_case
    from helpers.mla_cases import rel_err

    from specmla.ops.decode import mla_decode, route

    q, cache, table, seq, want, _ = poisoned_case("tbq4", H + S, lens, S, H, 64, True)
    q, cache, table, seq = q.bfloat16().cuda(), cache.cuda(), table.cuda(), seq.cuda()
    r = route(q, cache, table, kv_format="tbq4", head_dim_v=512)
    assert r.kernel == "tbq4" and r.plan["FOLD"] == S
    got = mla_decode(q, cache, table, seq, 0.0721, kv_format="tbq4", head_dim_v=512).float().cpu()
    assert not got.isnan().any()
    assert rel_err(got, want) < 6e-2
