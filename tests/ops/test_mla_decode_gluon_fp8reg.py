"""The fp8 decode kernel with Vᵀ in registers (`ops.mla_decode_gluon_fp8reg`): the whole kernel against the fp64
reference on ragged lengths (one key block, an odd block per consumer, many blocks, several splits) with NaN bytes
past each request's end, and the calls it must leave to the other kernels. GPU (Hopper) only; a CPU test compiles
it for sm_90 and checks its row order against the layouts it is built from."""

import pytest
import torch
from helpers.offline_compile import offline_sm90_rows
from helpers.quant_decode import assert_tokens_match, hopper
from helpers.quant_decode import quant_problem as _problem

from specmla.ops.decode.hopper import common as G
from specmla.ops.decode.hopper import fp8 as R
from specmla.ops.decode.hopper import quant_common as QC


def _run(q, cache, table, seq, splits, monkeypatch, p_format="fp16", q_cat=True, kv_format="fp8_ds_mla"):
    from specmla.ops.decode.triton import mla_decode_triton

    monkeypatch.setattr(R, "USE", True)
    monkeypatch.setattr(R, "P16", p_format == "fp16")
    monkeypatch.setattr(R, "P_SPLIT", p_format == "e4m3x2")
    monkeypatch.setattr(R, "Q_CAT", q_cat)
    launches = []
    launch = R.launch_fp8reg_split
    monkeypatch.setattr(R, "launch_fp8reg_split", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    got = mla_decode_triton(q, cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format=kv_format, gluon=True,
                            num_splits=splits)
    return got, launches


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens,splits,p_format,q_cat", [
    ([1, 63, 64, 65, 300, 1000], None, "fp16", True), ([4097, 77, 128], 1, "fp16", True),
    ([4097, 77, 128], 3, "fp16", True), ([130, 2], 1, "fp16", True), ([8192, 5000], 2, "fp16", True),
    ([1, 63, 64, 65, 300, 1000], None, "fp16", False), ([1, 63, 64, 65, 300, 1000], None, "e4m3x2", True),
    ([1, 63, 64, 65, 300, 1000], None, "e4m3", True), ([8192, 5000], 2, "e4m3", False)])
@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "fp8"])
def test_fp8reg_kernel_matches_the_reference(lens, splits, p_format, q_cat, kv_format, monkeypatch):
    """fp8 rows (608 bytes): the same kernel, the rope's int8 values converted to bf16 by the producer (`_convert_rope`)
    in the stage's rope tile."""
    from specmla.ops.decode import mla_decode_torch

    q, cache, table, seq = _problem(lens, 1, kv_format=kv_format)
    ref = mla_decode_torch(q.double(), cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format=kv_format)
    got, launches = _run(q, cache, table, seq, splits, monkeypatch, p_format, q_cat, kv_format)
    assert launches == [1]  # this kernel ran
    got = got.double()
    assert torch.isfinite(got).all()
    # P in fp16 or two e4m3 terms: about 0.2 %, as the unpacking kernel; in one: about 2.5 % (the bar is the
    # cosine)
    assert ((got - ref).norm() / ref.norm()).item() < (4e-2 if p_format == "e4m3" else 1e-2)
    cos = torch.nn.functional.cosine_similarity(got.flatten(2), ref.flatten(2), dim=-1)
    assert cos.min().item() > 0.999


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens,splits,kv_format", [
    ([1, 63, 64, 65, 300, 1000], None, "fp8_ds_mla"), ([4097, 77, 128], 3, "fp8_ds_mla"),
    ([8192, 5000], 2, "fp8_ds_mla"), ([4097, 77, 128], 3, "fp8")])
def test_fp8reg_loader_warp_gives_the_same_result(lens, splits, kv_format, monkeypatch):
    """LOADER (a one-warp partition issues the copies as stages are handed back) changes only when copies start:
    the result is the default's bit for bit."""
    q, cache, table, seq = _problem(lens, 1, kv_format=kv_format)
    monkeypatch.setattr(R, "ROPE_INT8_LOADER", False)  # 608-byte rows' default is the loader
    want, _ = _run(q, cache, table, seq, splits, monkeypatch, kv_format=kv_format)
    monkeypatch.setattr(R, "LOADER", True)
    monkeypatch.setattr(R, "ROPE_INT8_LOADER", True)
    got, launches = _run(q, cache, table, seq, splits, monkeypatch, kv_format=kv_format)
    assert launches == [1]
    assert torch.equal(got, want)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("kv_format", ["fp8", "fp8_ds_mla"])
def test_fp8reg_codes_from_registers_give_the_same_result(kv_format, monkeypatch):
    """REG_A (Q·Kᵀ's codes loaded into registers before the matmul) changes where the operand comes from, not the
    arithmetic: bit for bit the default's."""
    q, cache, table, seq = _problem([4097, 77, 128, 1], 1, kv_format=kv_format)
    want, _ = _run(q, cache, table, seq, 3, monkeypatch, kv_format=kv_format)
    monkeypatch.setattr(R, "REG_A", True)
    got, launches = _run(q, cache, table, seq, 3, monkeypatch, kv_format=kv_format)
    assert launches == [1]
    assert torch.equal(got, want)


def _steal(monkeypatch, min_blocks=1):
    monkeypatch.setattr(R, "STEAL", True)
    monkeypatch.setattr(R, "STEAL_MIN_BLOCKS", min_blocks)  # help even with one block left: small problems steal
    R._HELPER_BUFFERS.clear()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens,splits", [([8192, 64, 1, 300], 2), ([1, 63, 64, 65, 300, 1000], None),
                                         ([4097, 77, 128], 3), ([5000] * 3 + [40] * 30, None),
                                         ([2000] * 7 + [100], 4)])  # 32 programs: the counter scan's whole width
def test_fp8reg_steal_matches_the_reference(lens, splits, monkeypatch):
    """STEAL: programs whose share is done take blocks of the share with the most left and store their partial in
    that share's helper slot, which the combine adds. Against the fp64 reference as the static kernel, three calls in
    a row (the block counters go back to zero after each: the last program resets them), shares that were helped."""
    from specmla.ops.decode import mla_decode_torch

    q, cache, table, seq = _problem(lens, 1)
    ref = mla_decode_torch(q.double(), cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format="fp8_ds_mla")
    _steal(monkeypatch)
    helped = 0
    for _ in range(3):
        got, launches = _run(q, cache, table, seq, splits, monkeypatch)
        assert launches == [1]
        torch.cuda.synchronize()
        ((claims, _, help_lse),) = R._HELPER_BUFFERS.values()
        assert claims.eq(0).all()  # counters back at zero
        helped += int((help_lse > float("-inf")).sum())
        got = got.double()
        assert torch.isfinite(got).all()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2
        cos = torch.nn.functional.cosine_similarity(got.flatten(2), ref.flatten(2), dim=-1)
        assert cos.min().item() > 0.999
    if lens[0] == 8192 or len(lens) > 30:  # long requests among short ones: their shares get help
        assert helped > 0


@pytest.mark.gpu
@hopper
def test_fp8reg_steal_replays_in_a_cuda_graph(monkeypatch):
    """STEAL in a CUDA graph: the counters' reset is part of each replay, so replays agree with the eager call."""
    from specmla.ops.decode.triton import mla_decode_triton

    q, cache, table, seq = _problem([3000, 64, 900, 5], 1)
    _steal(monkeypatch)
    monkeypatch.setattr(R, "USE", True)
    want = mla_decode_triton(q, cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format="fp8_ds_mla", gluon=True)
    out = torch.empty_like(want)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_triton(q, cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format="fp8_ds_mla", gluon=True,
                          out=out)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        # which program takes which block varies, so the sums' order does: equal up to rounding
        assert ((out.float() - want.float()).norm() / want.float().norm()).item() < 1e-3


@pytest.mark.gpu
@hopper
def test_fp8reg_q_in_one_term_ignores_q_cat(monkeypatch):
    """With q in one e4m3 term there is no lo term to join: Q_CAT on gives Q_CAT off's result bit for bit (it read
    unwritten lo tiles before the launch turned it off)."""
    q, cache, table, seq = _problem([4097, 77, 128], 1)
    monkeypatch.setattr(R, "Q_SPLIT", False)
    want, _ = _run(q, cache, table, seq, 3, monkeypatch, q_cat=False)
    got, launches = _run(q, cache, table, seq, 3, monkeypatch, q_cat=True)
    assert launches == [1]
    assert torch.equal(got, want)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("kv_format", ["fp8", "fp8_ds_mla"])
@pytest.mark.parametrize("lens,S,splits", [([700, 90, 3], 2, None), ([4097, 77], 3, 2), ([1, 64, 300], 4, None)])
def test_fp8reg_takes_several_query_tokens_one_per_program(lens, S, splits, kv_format, monkeypatch):
    """S > 1 query tokens (H = 16), 608- and 656-byte rows: one token's 16 rows per program (no folding), each with
    its own causal limit, instead of the other kernels (the 64-row kernel's route off); against the fp64 reference
    with NaN bytes past each request's end."""
    from specmla.ops.decode import mla_decode_torch

    q, cache, table, seq = _problem(lens, S, kv_format=kv_format)
    ref = mla_decode_torch(q.double(), cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format=kv_format)
    got, launches = _run(q, cache, table, seq, splits, monkeypatch, kv_format=kv_format)
    assert launches == [1]
    assert_tokens_match(got, ref, lens, S, max_err=1e-2, min_cos=0.999)


@pytest.mark.gpu
@hopper
def test_fp8reg_leaves_32_row_calls_to_the_other_kernels(monkeypatch):
    from specmla.ops.decode import mla_decode_torch

    q, cache, table, seq = _problem([700, 90], 1, H=32)  # 32 heads: 32 rows
    got, launches = _run(q, cache, table, seq, None, monkeypatch)
    assert launches == []
    ref = mla_decode_torch(q.double(), cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format="fp8_ds_mla")
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2


def _bits(x: int, n: int) -> list[int]:
    return [(x >> i) & 1 for i in range(n)]


def _position(bases_by_level, index):
    """(register, lane, warp) → the (m, k) element a linear layout gives it (XOR of the set bits' bases)."""
    m = k = 0
    for bases, x in zip(bases_by_level, index):
        for bit, (bm, bk) in zip(_bits(x, len(bases)), bases):
            if bit:
                m ^= bm
                k ^= bk
    return m, k


# the e4m3 Vᵀ fragment [128, 64] (Triton's DotOperand layout, k_width 4, for an m64nNk32 wgmma, 4 warps): the
# (m, k) bases of its registers, lanes and warps
E4M3_FRAGMENT = ([(0, 1), (0, 2), (8, 0), (0, 16), (0, 32), (64, 0)], [(0, 4), (0, 8), (1, 0), (2, 0), (4, 0)],
                 [(16, 0), (32, 0)])


def _key_of_k(k):
    """The stage key of the e4m3 fragment's key index k (Pᵀ's order, `_store_pt`): k0 e0, k1 e3, k2 e1, k3 e2,
    k4 e4, k5 e5."""
    e = [0] * 6
    for kb, eb in zip(range(6), (0, 3, 1, 2, 4, 5)):
        e[eb] = (k >> kb) & 1
    return sum(b << i for i, b in enumerate(e))


@pytest.mark.skipif(not G.HAVE_GLUON, reason="needs Gluon")
def test_fp8reg_row_and_key_orders_follow_the_layouts():
    """The load layout, the 4 × 4 byte transpose and the index permutation give every tile element (m, k) the code of
    key `_key_of_k(k)` (Pᵀ's order) and column `column_of_m(m)` (`_latent_column` FMT 3, the output's order), in the
    thread and byte position where the wgmma fragment expects it: checked thread by thread on the layouts' bases,
    in plain Python."""
    load = QC.V_LOAD.value
    loaded_at = (load.reg_bases, load.lane_bases, load.warp_bases)  # (register, lane, warp) → (key, column)

    # the transpose: register r = (byte b = r0 r1, word w = r2 r3, rest) receives the input at (byte w, word b)
    def after_transpose(reg):
        b, w, rest = reg & 3, (reg >> 2) & 3, reg >> 4
        return (rest << 4) | (b << 2) | w

    def column_of_m(m):  # `_latent_column` FMT 3 within a chunk
        return ((m >> 3) & 1) | (((m >> 6) & 1) << 1) | ((m & 7) << 2) | (((m >> 4) & 3) << 5)

    def label(key, col):  # the (m, k) index `_vt_fragment`'s reshape + permute gives a loaded (key, col) label
        m = (((col >> 2) & 7) | ((key & 1) << 3) | (((col >> 5) & 3) << 4) | (((key >> 3) & 1) << 6))
        k = ((col & 3) | (((key >> 1) & 3) << 2) | (((key >> 4) & 3) << 4))
        return m, k

    frag = {}
    for warp in range(4):
        for lane in range(32):
            for reg in range(64):
                frag[_position(E4M3_FRAGMENT, (reg, lane, warp))] = (reg, lane, warp)
    assert len(frag) == 128 * 64
    for warp in range(4):
        for lane in range(32):
            for reg in range(64):
                m, k = label(*_position(loaded_at, (reg, lane, warp)))
                # what the register holds after the transpose
                key, col = _position(loaded_at, (after_transpose(reg), lane, warp))
                assert (key, col) == (_key_of_k(k), column_of_m(m)), (reg, lane, warp)
                # convert_layout to the fragment moves whole 32-bit registers within the thread, nothing else
                f_reg, f_lane, f_warp = frag[(m, k)]
                assert (f_lane, f_warp, f_reg & 3) == (lane, warp, reg & 3), (reg, lane, warp)


def test_f16_fragment_only_relabels_keys_and_renames_registers():
    """`_f16_fragment`: the e4m3 Vᵀ fragment [128, 64] (k_width 4, m64nNk32) converted element-wise to fp16 and its key
    bits permuted by `F16_KEY_ORDER` lands on the fp16 fragment (k_width 2, m64nNk16) in the same lanes and warps,
    each converted pair of codes in one 32-bit register; composed with `_vt_fragment`'s key order, the keys come out
    in stage order, so Pᵀ is stored unpermuted (`_store_p16`). Bases from the PTX wgmma fragment layouts."""
    frag16 = ([(0, 1), (8, 0), (0, 8), (0, 16), (0, 32), (64, 0)], [(0, 2), (0, 4), (1, 0), (2, 0), (4, 0)],
              [(16, 0), (32, 0)])
    # the permutation as the kernel applies it: dims (m, k5 … k0) → QC.F16_KEY_ORDER; new key index of each old one
    idx = torch.arange(64).view(1, 2, 2, 2, 2, 2, 2)
    new_of_old = torch.empty(64, dtype=torch.long)
    new_of_old[idx.permute(QC.F16_KEY_ORDER).reshape(64)] = torch.arange(64)
    where16 = {}
    for warp in range(4):
        for lane in range(32):
            for reg in range(64):
                where16[_position(frag16, (reg, lane, warp))] = (reg, lane, warp)
    assert len(where16) == 128 * 64
    pair_to_register = {}
    for warp in range(4):
        for lane in range(32):
            for reg in range(64):
                m, k = _position(E4M3_FRAGMENT, (reg, lane, warp))
                r16, l16, w16 = where16[(m, int(new_of_old[k]))]
                assert (l16, w16) == (lane, warp) and (r16 & 1) == (reg & 1), (reg, lane, warp)
                assert pair_to_register.setdefault((lane, warp, reg >> 1), r16 >> 1) == r16 >> 1
    # `_vt_fragment`'s key order, then the relabelling: the identity
    for k in range(64):
        assert _key_of_k(k) == int(new_of_old[k])


def test_fp8reg_kernel_compiles_for_sm90():
    """CPU: the kernel compiles for sm_90 on 656-byte rows (split and direct) and 608-byte rows."""
    for row in offline_sm90_rows([[16, 1, 512, 64, "e4m3_fp8_ds_mla", False], [16, 1, 512, 64, "e4m3_fp8_ds_mla", True],
                                  [16, 1, 512, 64, "e4m3_fp8", False]]):
        (k,) = row["kernels"]
        assert k["shared"] <= 232448 and k["regs"] > 0
