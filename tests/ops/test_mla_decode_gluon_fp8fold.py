"""The 64-row fp8 decode kernel for several query tokens (`ops.mla_decode_gluon_fp8fold`): the whole kernel against
the fp64 reference for S = 2, 3, 4 folded tokens (H = 16; and H = 128, S = 2) on 608- and 656-byte rows, with ragged
lengths, NaN bytes past each request's end, a token that sees no key and several splits; the calls it leaves to the
other kernels; the route's choice. GPU (Hopper) only, except a CPU test that compiles it for sm_90 and one of the
route's rule."""

import pytest
import torch
from helpers.offline_compile import offline_sm90_rows
from test_mla_decode_gluon_fp8mma import _problem, assert_tokens_match, hopper

from specmla.ops.decode.hopper import fp8fold as F
from specmla.ops.decode import triton as T

DEFAULT_ROUTE = T.FOLDED_E4M3_FORMATS  # before any test changes it


def _run(q, cache, table, seq, splits, monkeypatch, kv_format, gluon=True, route=("fp8", "fp8_ds_mla")):
    monkeypatch.setattr(T, "FOLDED_E4M3_FORMATS", route)  # the route is off by default (slower, for now)
    launches = []
    launch = F.launch_fp8fold_split
    monkeypatch.setattr(F, "launch_fp8fold_split", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    got = T.mla_decode_triton(q, cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format=kv_format, gluon=gluon,
                              num_splits=splits)
    return got, launches


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("kv_format", ["fp8", "fp8_ds_mla"])
@pytest.mark.parametrize("lens,S,H,splits", [([700, 90, 3], 2, 16, None), ([4097, 77], 3, 16, 2),
                                             ([1, 64, 300], 4, 16, None), ([8192, 5000], 4, 16, 3),
                                             ([130, 2], 4, 16, 1), ([65, 1000, 129], 4, 16, None),
                                             ([700, 1], 2, 128, None)])
def test_fp8fold_matches_the_reference(lens, S, H, splits, kv_format, monkeypatch):
    """S tokens' rows in one program (H = 16; H = 128: one token's 64 heads per program, two head blocks), each row
    with its own causal limit; P·V's Pᵀ in two e4m3 terms and q in two: within 1 % of the fp64 reference and every
    row's cosine over 0.999 (the issue's bar)."""
    from specmla.ops.decode import mla_decode_torch

    q, cache, table, seq = _problem(lens, S, H=H, kv_format=kv_format)
    ref = mla_decode_torch(q.double(), cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format=kv_format)
    got, launches = _run(q, cache, table, seq, splits, monkeypatch, kv_format)
    assert launches == [1]
    assert_tokens_match(got, ref, lens, S, max_err=1e-2, min_cos=0.999)


@pytest.mark.gpu
@hopper
def test_fp8fold_result_does_not_depend_on_the_split_count(monkeypatch):
    """The same call in one split (the kernel writes the output) and in four (partials merged by the combine): equal
    within the combine's rounding."""
    q, cache, table, seq = _problem([3000, 640], 4, kv_format="fp8")
    one, _ = _run(q, cache, table, seq, 1, monkeypatch, "fp8")
    four, launches = _run(q, cache, table, seq, 4, monkeypatch, "fp8")
    assert launches == [1]
    assert ((one.float() - four.float()).norm() / one.float().norm()).item() < 1e-2


@pytest.mark.gpu
@hopper
def test_fp8fold_leaves_other_calls(monkeypatch):
    """S = 1 (16 rows: the 16-row kernel), tbq4, and every call with the route as it is by default (off) go
    elsewhere."""
    q, cache, table, seq = _problem([700, 90], 1, kv_format="fp8")
    assert _run(q, cache, table, seq, None, monkeypatch, "fp8")[1] == []
    q, cache, table, seq = _problem([700, 90], 2, kv_format="tbq4")
    assert _run(q, cache, table, seq, None, monkeypatch, "tbq4")[1] == []
    q, cache, table, seq = _problem([700, 90], 4, kv_format="fp8")
    assert _run(q, cache, table, seq, None, monkeypatch, "fp8", route=DEFAULT_ROUTE)[1] == []


def test_fold64_route_needs_several_tokens_an_fp8_format_and_hopper(monkeypatch):
    """CPU: S = 1, tbq4 and bf16 never take the 64-row kernel, and off Hopper (here: CPU tensors) nothing does."""
    monkeypatch.setattr(T, "FOLDED_E4M3_FORMATS", ("fp8", "fp8_ds_mla"))
    q4 = torch.randn(2, 4, 16, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 608, dtype=torch.uint8)
    assert not T._fold64_takes(q4, cache, 512, 4, 16, "fp8")  # not on a Hopper GPU
    assert not T._fold64_takes(q4[:, :1], cache, 512, 1, 16, "fp8")
    for fmt in ("tbq4", "bf16", "auto"):
        assert not T._fold64_takes(q4, cache, 512, 4, 16, fmt)
    assert not F.fp8fold_supported(q4, cache, 512, 16, "fp8")  # 16 rows: the 16-row kernel's
    assert not F.fp8fold_supported(q4, cache, 512, 128, "fp8")  # over 64 rows


def test_fp8fold_kernel_compiles_for_sm90():
    """CPU: the kernel compiles for sm_90 on both fp8 layouts, split and direct, within shared memory."""
    for row in offline_sm90_rows([[16, 4, 512, 64, "fp8fold", False], [16, 2, 512, 64, "fp8fold", True],
                                  [16, 4, 512, 64, "fp8fold_rope_int8", False],
                                  [16, 3, 512, 64, "fp8fold_rope_int8", True]]):
        (k,) = row["kernels"]
        assert k["name"] == "_mla_decode_fp8fold_kernel" and k["shared"] <= 232448 and k["regs"] > 0
