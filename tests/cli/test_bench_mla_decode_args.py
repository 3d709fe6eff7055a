"""bench_mla_decode's CPU-side helpers: argument parsing, quantised byte counts, cache building."""

import sys
from pathlib import Path

import pytest
import torch
from helpers.mla_cases import rel_err

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_mla_decode as bm  # noqa: E402

from specmla.ops.decode import tune as decode_tune  # noqa: E402
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


def test_flashmla_peer_needs_the_package(monkeypatch, capsys):
    """--flashmla is refused up front, with the reason, where flash_mla cannot be imported (not mid-run)."""
    import sys

    monkeypatch.setitem(sys.modules, "flash_mla", None)  # import flash_mla → ImportError
    with pytest.raises(SystemExit):
        bm.parse_args(["--flashmla"])
    assert "flash_mla package is not importable" in capsys.readouterr().err


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
    caches, table, seq, qs = decode_tune.make_problem(H=2, B=2, T=2 * bm.PAGE, S=1, copies=1, kv=kv, device="cpu")
    cache = caches[0]
    assert cache.shape == (4, bm.PAGE, 576 if kv == "bf16" else bm.row_bytes(kv))
    assert table.shape == (2, 2) and seq.tolist() == [128, 128] and qs[0].shape == (2, 1, 2, 576)
    torch.manual_seed(0)
    latent = torch.randn(3, bm.PAGE, 576, dtype=torch.bfloat16)
    back = decode_rows(kv, decode_tune.make_cache(kv, latent), 512, 64)
    assert rel_err(back[..., :512], latent[..., :512].float()) <= tol
    if kv == "fp8":  # the rope in int8 with one scale per 8 values: within 1 %
        assert rel_err(back[..., 512:], latent[..., 512:].float()) <= 0.01
    else:
        assert torch.equal(back[..., 512:], latent[..., 512:].float())  # rope part stays bf16


def test_ragged_cases_draw_their_lengths_and_count_them():
    """--ragged: each case's B lengths drawn from S … T (fixed seed, so every format of a case reads the same
    batch), the requests that long; lengths out of range are refused."""
    assert bm.parse_args(["--ragged"]).ragged and not bm.parse_args([]).ragged
    with pytest.raises(SystemExit):
        bm.parse_args(["--ragged", "--routes"])  # a routes table keyed by uniform (B, T)
    lens = bm.ragged_lengths(64, 4096, 3)
    assert lens == bm.ragged_lengths(64, 4096, 3) and min(lens) >= 3 and max(lens) <= 4096 and len(set(lens)) > 32
    caches, table, seq, qs = decode_tune.make_problem(H=2, B=3, T=2 * bm.PAGE, S=2, copies=1, device="cpu",
                                                      lens=[2, 77, 128])
    assert seq.tolist() == [2, 77, 128] and table.shape == (3, 2)
    for bad in ([1, 77, 128], [2, 77, 129], [2, 77]):
        with pytest.raises(ValueError, match="lens"):
            decode_tune.make_problem(H=2, B=3, T=2 * bm.PAGE, S=2, copies=1, device="cpu", lens=bad)


def test_routes_table_takes_the_fastest_kernel_per_case():
    """`--routes` rows → the table dispatch reads: per (format, S, H), [B, T, fastest] of each timed case, the µs
    beside; rows without kernel timings are left out. The dispatcher then routes a nearby call to that kernel."""
    from specmla.ops.decode import dispatch

    assert bm.parse_args(["--routes"]).routes and not bm.parse_args([]).routes
    rows = [dict(kv="tbq4", S=4, H=16, B=32, T=32768, kernels_s={"tbq4": 7.9e-4, "dequant_seesaw": 2.6e-4}),
            dict(kv="tbq4", S=4, H=16, B=1, T=8192, kernels_s={"triton": 1.1e-5, "dequant_seesaw": 1.4e-5,
                                                                "dequant_seesaw@64": 0.9e-5}),
            dict(kv="bf16", S=1, H=16, B=1, T=8192, ours_s=1.2e-5)]
    out = bm.routes_table(rows, "NVIDIA H100 80GB HBM3")
    # the table names kernels at their planned splits; "name@n" timings are evidence only
    assert out["routes"] == {"tbq4,4,16": [[32, 32768, "dequant_seesaw"], [1, 8192, "triton"]]}
    assert out["us"]["tbq4,4,16"][0] == [32, 32768, {"tbq4": 790.0, "dequant_seesaw": 260.0}]
    assert out["device"] == "NVIDIA H100 80GB HBM3" and out["date"] and "--routes" in out["command"]
    assert dispatch.measured_kernel(out["routes"], "tbq4", 16, 4, 16, 65536) == "dequant_seesaw"
    assert dispatch.measured_kernel(out["routes"], "tbq4", 2, 4, 16, 4096) == "triton"
    assert dispatch.measured_kernel(out["routes"], "fp8", 2, 4, 16, 4096) is None
    for fmt in bm.FORMATS:
        assert set(bm.ROUTE_CANDIDATES[fmt]) <= set(dispatch.KERNELS)
