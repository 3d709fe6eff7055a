"""bench_mla_decode's CPU-side helpers: argument parsing, quantised byte counts, cache building."""

import sys
from pathlib import Path

import pytest
import torch
from helpers.mla_cases import rel_err

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_mla_decode as bm  # noqa: E402

from specmla.ops.kv_cache import decode_rows  # noqa: E402
from specmla.ops.decode.dispatch import decode_bytes  # noqa: E402


def test_args():
    a = bm.parse_args([])
    assert a.kv == ["bf16"] and a.cases == bm.CASES and a.variants is None
    a = bm.parse_args(["--kv", "tbq4,fp8", "--kv", "bf16", "--cases", "16x32x32768x1,16x4x81920x4", "--variants", "2"])
    assert a.kv == ["bf16", "fp8", "tbq4"]  # bf16 first: the speedup baseline
    assert a.cases == [(16, 32, 32768, 1), (16, 4, 81920, 4)] and a.variants == 2
    assert bm.parse_args(["--quick"]).variants == 1
    for bad in (["--kv", "int4"], ["--cases", "16x32x100x1"], ["--cases", "16x32"], ["--variants", "0"]):
        with pytest.raises(SystemExit):
            bm.parse_args(bad)
    for case in [(16, 32, 32768, 1), (16, 4, 81920, 1), (16, 32, 32768, 4), (16, 4, 81920, 4)]:
        assert case in bm.CASES  # the issue-7 acceptance shapes


def test_byte_counts():
    assert [bm.row_bytes(k) for k in ("bf16", "fp8_ds_mla", "fp8", "tbq4")] == [1152, 656, 608, 400]
    for B, T, S, H in [(32, 32768, 1, 16), (4, 81920, 4, 16), (3, 7, 2, 128)]:
        qo = B * S * H * (576 + 512) * 2
        assert bm.kv_decode_bytes("bf16", B * T, B, S, H) == decode_bytes(B * T, B, S, H)
        assert bm.kv_decode_bytes("fp8_ds_mla", B * T, B, S, H) == B * T * 656 + qo
        assert bm.kv_decode_bytes("fp8", B * T, B, S, H) == B * T * 608 + qo
        assert bm.kv_decode_bytes("tbq4", B * T, B, S, H) == B * T * 400 + qo


@pytest.mark.parametrize("kv,tol", [("bf16", 0.0), ("fp8", 0.05), ("fp8_ds_mla", 0.05), ("tbq4", 0.15)])
def test_cache_round_trip(kv, tol):
    caches, table, seq, qs = bm.make_problem(H=2, B=2, T=2 * bm.PAGE, S=1, copies=1, kv=kv, device="cpu")
    cache = caches[0]
    assert cache.shape == (4, bm.PAGE, 576 if kv == "bf16" else bm.row_bytes(kv))
    assert table.shape == (2, 2) and seq.tolist() == [128, 128] and qs[0].shape == (2, 1, 2, 576)
    torch.manual_seed(0)
    latent = torch.randn(3, bm.PAGE, 576, dtype=torch.bfloat16)
    back = decode_rows(kv, bm.make_cache(kv, latent), 512, 64)
    assert rel_err(back[..., :512], latent[..., :512].float()) <= tol
    if kv == "fp8":  # the rope in int8 with one scale per 8 values: within 1 %
        assert rel_err(back[..., 512:], latent[..., 512:].float()) <= 0.01
    else:
        assert torch.equal(back[..., 512:], latent[..., 512:].float())  # rope part stays bf16
