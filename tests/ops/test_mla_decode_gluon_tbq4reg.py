"""The tbq4 decode kernel that decodes codes into e4m3 for the fp8 kernel's consumers (`ops.mla_decode_gluon_tbq4reg`):
the whole kernel against the fp64 tbq4 reference on ragged lengths (one key block, an odd block per consumer, many
blocks, several splits) with 0xFF bytes (NaN norms and rope) past each request's end, and the calls it must leave
to the other kernels. GPU (Hopper) only; on the CPU: its byte-permute lookup, emulated, against the centroid table,
and an sm_90 compile."""

import random

import pytest
import torch
from helpers.offline_compile import offline_sm90_rows
from helpers.quant_decode import assert_tokens_match, hopper
from helpers.quant_decode import quant_problem as _problem

from specmla.ops.decode.hopper import tbq4 as T
from specmla.ops.kv_cache import tbq4


def _run(q, cache, table, seq, splits, monkeypatch):
    from specmla.ops.decode.triton import mla_decode_triton

    monkeypatch.setattr(T, "USE", True)
    launches = []
    launch = T.launch_tbq4reg_split
    monkeypatch.setattr(T, "launch_tbq4reg_split", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    got = mla_decode_triton(q, cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format="tbq4", gluon=True,
                            num_splits=splits)
    return got, launches


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens,splits", [([1, 63, 64, 65, 300, 1000], None), ([4097, 77, 128], 1),
                                         ([4097, 77, 128], 3), ([130, 2], 1), ([8192, 5000], 2)])
def test_tbq4reg_kernel_matches_the_reference(lens, splits, monkeypatch):
    from specmla.ops.decode import mla_decode_torch

    q, cache, table, seq = _problem(lens, 1, kv_format="tbq4")
    ref = mla_decode_torch(q.double(), cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format="tbq4")
    got, launches = _run(q, cache, table, seq, splits, monkeypatch)
    assert launches == [1]  # this kernel ran
    got = got.double()
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
@pytest.mark.parametrize("code_box", [16, 32])
def test_tbq4reg_code_box_width_does_not_change_the_result(code_box, monkeypatch):
    """Code boxes of one or two chunks' codes per TMA copy land the same words as the default whole-row box."""
    q, cache, table, seq = _problem([4097, 77, 128], 1, kv_format="tbq4")
    want, _ = _run(q, cache, table, seq, 3, monkeypatch)
    monkeypatch.setattr(T, "CODE_BOX", code_box)
    got, launches = _run(q, cache, table, seq, 3, monkeypatch)
    assert launches == [1]
    assert torch.equal(got, want)


@pytest.mark.gpu
@hopper
def test_tbq4reg_codes_from_registers_give_the_same_result(monkeypatch):
    """REG_A (Q·Kᵀ's codes loaded into registers before the matmul) changes where the operand comes from, not the
    arithmetic: bit for bit the default's."""
    q, cache, table, seq = _problem([4097, 77, 128, 1], 1, kv_format="tbq4")
    want, _ = _run(q, cache, table, seq, 3, monkeypatch)
    monkeypatch.setattr(T, "REG_A", True)
    got, launches = _run(q, cache, table, seq, 3, monkeypatch)
    assert launches == [1]
    assert torch.equal(got, want)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens,splits,raw", [([1, 63, 64, 65, 300, 1000], None, 4), ([4097, 77, 128], 3, 4),
                                             ([8192, 5000], 2, 3)])
def test_tbq4reg_rope_straight_into_the_decoded_stage(lens, splits, raw, monkeypatch):
    """ROPE_DIRECT (the default: the rope's copy lands in the decoded stage; the stage is ready after that copy and
    the producer's arrive) gives the result of the rope through the raw ring bit for bit, with 3 raw stages of 17 KB
    or 4 (4 gains nothing: see the module)."""
    q, cache, table, seq = _problem(lens, 1, kv_format="tbq4")
    monkeypatch.setattr(T, "ROPE_DIRECT", False)
    monkeypatch.setattr(T, "NUM_RAW", 3)
    want, _ = _run(q, cache, table, seq, splits, monkeypatch)
    monkeypatch.setattr(T, "ROPE_DIRECT", True)
    monkeypatch.setattr(T, "NUM_RAW", raw)
    got, launches = _run(q, cache, table, seq, splits, monkeypatch)
    assert launches == [1]
    assert torch.equal(got, want)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens,S,splits", [([700, 90, 3], 2, None), ([4097, 77], 3, 2), ([1, 64, 300], 4, None)])
def test_tbq4reg_takes_several_query_tokens_one_per_program(lens, S, splits, monkeypatch):
    """S > 1 query tokens (H = 16): one token's 16 rows per program (no folding), each with its own causal limit;
    against the fp64 tbq4 reference, 0xFF bytes past each request's end, a token that sees no key (length 1)."""
    from specmla.ops.decode import mla_decode_torch

    q, cache, table, seq = _problem(lens, S, kv_format="tbq4")
    ref = mla_decode_torch(q.double(), cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format="tbq4")
    got, launches = _run(q, cache, table, seq, splits, monkeypatch)
    assert launches == [1]
    assert_tokens_match(got, ref, lens, S, max_err=5e-2, min_cos=0.998)


@pytest.mark.gpu
@hopper
def test_tbq4reg_leaves_32_row_calls_to_the_other_kernels(monkeypatch):
    from specmla.ops.decode import mla_decode_torch

    q, cache, table, seq = _problem([700, 90], 1, H=32, kv_format="tbq4")  # 32 heads: 32 rows
    got, launches = _run(q, cache, table, seq, None, monkeypatch)
    assert launches == []
    ref = mla_decode_torch(q.double(), cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format="tbq4")
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


def test_tbq4reg_kernel_compiles_for_sm90():
    """CPU: the kernel compiles for sm_90 and fits the shared memory, also with 4 raw stages."""
    for row in offline_sm90_rows([[16, 1, 512, 64, "e4m3_tbq4", False], [16, 1, 512, 64, "e4m3_tbq4", True],
                                  [16, 1, 512, 64, "e4m3_tbq4", False, 64, {"num_raw": 4}]]):
        (k,) = row["kernels"]
        assert k["shared"] <= 232448 and k["regs"] > 0
