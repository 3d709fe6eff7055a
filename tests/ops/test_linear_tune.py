"""The FP8 linear's launch search (`ops.linear.tune`) with a stand-in timer (the GPU timer is `LinearTimer`), its
table (`ops.linear.tuning`): rows picked per regime, bad rows reported naming the file, a row's knobs reaching the
kernels without changing the result (CPU interpreter), and `specmla tune`'s plumbing for an FP8 checkpoint."""

import time

import pytest
import torch
from helpers.hf_models import V3_BASE

from specmla.config import FP8_QUANTIZATION, ModelConfig
from specmla.ops import tuned
from specmla.ops.linear import fp8_block_linear_torch, fp8_block_linear_triton, tuning, weight_quant
from specmla.ops.linear import triton as linear_triton
from specmla.ops.linear.tune import coarse_space, fine_space, fits, rules, search, tune_shapes
from specmla.tune import applicable_ops, linear_keys, linear_shapes, tune_linear

DECODE = {"split": 2, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
GEMM = {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


def favouring(best: dict, seen=None):
    """A timer whose fastest knobs are `best`: each knob away from it costs more; None for BLOCK_N 128 (a failure)."""
    def timer(knobs: dict):
        if seen is not None:
            seen.append(dict(knobs))
        if knobs.get("BLOCK_N") == 128:
            return None
        keys = set(best) | set(knobs)
        return 1e-5 * (1 + sum(abs(knobs.get(k, 0) - best.get(k, 0)) / max(knobs.get(k, 1), best.get(k, 1), 1)
                               for k in keys))
    return timer


# ---- the table -------------------------------------------------------------------------------------------------
def test_rows_are_picked_by_bucket_and_never_across_regimes():
    rows = [(1, dict(DECODE, split=1)), (16, DECODE), (64, dict(DECODE, split=4)), (1024, GEMM),
            (4096, dict(GEMM, BLOCK_M=128))]
    assert tuning.pick(rows, 1)["split"] == 1
    assert tuning.pick(rows, 2) == DECODE and tuning.pick(rows, 16) == DECODE
    assert tuning.pick(rows, 64)["split"] == 4
    assert tuning.pick(rows, 65) == GEMM and tuning.pick(rows, 1024) == GEMM
    assert tuning.pick(rows, 4097)["BLOCK_M"] == 128  # past the last row: the last GEMM row
    got = tuning.pick(rows, 1)
    got["split"] = 99  # a copy: the table is not changed through it
    assert tuning.pick(rows, 1)["split"] == 1
    assert tuning.pick(rows[:3], 65) is None  # no GEMM row: the rules
    assert tuning.pick(rows[3:], 3) is None  # no split-K row: the rules


@pytest.mark.parametrize("row,match", [
    ([8, {"split": 2, "BLOCK_N": 32, "num_warps": 4}], "takes"),  # num_stages missing
    ([8, dict(DECODE, BLOCK_M=16)], "takes"),  # BLOCK_M is the kernel's, not the table's, up to 64 rows
    ([256, DECODE], "takes"),  # split-K knobs on a GEMM row
    ([8, dict(DECODE, BLOCK_N=48)], "power of two"),
    ([8, dict(DECODE, split=0)], "integer from"),
    ([8, dict(DECODE, num_stages=2.5)], "integer from"),
    ([8, dict(DECODE, num_warps=16)], "integer from 1 to 8"),
    ([8, dict(DECODE, BLOCK_N=512)], "integer from 16 to 256"),
    ([8, dict(DECODE, PREFETCH=3)], "power of two"),
    ([4096, dict(GEMM, BLOCK_M=256, BLOCK_N=256, num_stages=8)], "shared memory"),
    ([0, DECODE], "max_rows"),
    (["64", DECODE], "max_rows"),
    ([True, DECODE], "max_rows"),
    ([8, [1, 2]], "object"),
    ([8], "a row must be"),
])
def test_a_bad_row_is_reported_naming_the_file(tuned_tables, row, match):
    path = tuned.write("fp8_linear", "Fake_GPU", {"7,300": [[1, DECODE], row]})
    with pytest.raises(ValueError, match=match) as e:
        tuning._rows("Fake_GPU", tuned.generation())
    assert str(path) in str(e.value) and "7,300" in str(e.value)


def test_a_good_table_parses_sorted(tuned_tables):
    tuned.write("fp8_linear", "Fake_GPU", {"7,300": [[4096, GEMM], [1, dict(DECODE, PREFETCH=0)]]})
    assert tuning._rows("Fake_GPU", tuned.generation()) == {"7,300": [(1, dict(DECODE, PREFETCH=0)), (4096, GEMM)]}


def test_no_table_applies_off_cuda():
    assert tuning.lookup(200, 300, 4, torch.device("cpu")) is None


class Recorder:
    """Stands in for a Triton kernel object: records each launch's keyword arguments, then launches the real one."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("M,knobs", [(3, DECODE), (5, dict(DECODE, split=1, BLOCK_N=64, PREFETCH=0)), (70, GEMM)])
def test_a_table_row_sets_the_kernel_knobs_and_not_the_result(monkeypatch, M, knobs):
    """A row of the table reaches the launch (split-K's SPLIT and tiles, the GEMM's tiles) and the output equals
    the one without a table (the same arithmetic) and the torch reference; knobs passed by the caller win."""
    N, K = 200, 700  # 6 K blocks; N not a multiple of any tile
    g = torch.Generator().manual_seed(M)
    w, s = weight_quant(torch.randn(N, K, generator=g) * 0.05)
    x = torch.randn(M, K, generator=g)
    rules = fp8_block_linear_triton(x, w, s)
    calls = []
    monkeypatch.setattr(tuning, "lookup", lambda n, k, m, device: dict(knobs) if (n, k) == (N, K) else None)
    monkeypatch.setattr(linear_triton, "_splitk_kernel", Recorder(linear_triton._splitk_kernel, calls))
    monkeypatch.setattr(linear_triton, "_gemm_kernel", Recorder(linear_triton._gemm_kernel, calls))
    out = torch.full((M, N), float("nan"))
    y = fp8_block_linear_triton(x, w, s, out=out)
    (launch,) = calls
    if M <= tuning.DECODE_MAX_M:
        assert launch["SPLIT"] == knobs["split"] and launch["BLOCK_N"] == knobs["BLOCK_N"]
        assert launch["num_stages"] == knobs["num_stages"] and launch["PREFETCH"] == knobs.get("PREFETCH", 4)
    else:
        assert all(launch[k] == v for k, v in knobs.items())
    torch.testing.assert_close(y, rules, rtol=1e-5, atol=1e-5 * rules.abs().max().item())
    ref = fp8_block_linear_torch(x, w, s)
    assert ((y - ref).norm() / ref.norm()).item() <= 3e-2
    calls.clear()
    mine = {"BLOCK_N": 128 if knobs["BLOCK_N"] != 128 else 32} if M <= 64 else {"BLOCK_M": 128}
    fp8_block_linear_triton(x, w, s, split=1, config=mine)  # the caller's knobs, not the table's
    assert all(calls[0][k] == v for k, v in mine.items()) and (M > 64 or calls[0]["SPLIT"] == 1)


# ---- the search ------------------------------------------------------------------------------------------------
def test_the_search_starts_from_the_rules_and_never_plans_an_empty_program(monkeypatch):
    """The first candidate is what the kernel runs without a table (a search cut short keeps it unless beaten);
    every split has K blocks; the spaces leave out pipelines past the shared memory."""
    N, K, sms = 2112, 7168, 132
    kb = K // 128
    monkeypatch.setattr(linear_triton, "_num_sms", lambda device: sms)
    g = torch.Generator().manual_seed(0)
    w, s = weight_quant(torch.randn(N, 256, generator=g))
    for M in (1, 16, 64, 256, 4096):
        coarse = coarse_space(N, K, M, sms)
        assert coarse[0] == rules(N, K, M, sms) and len(coarse) > 3
        assert len({repr(sorted(c.items())) for c in coarse}) == len(coarse)
        for c in coarse:
            if M <= 64:
                sp = c["split"]
                assert 1 <= sp <= kb and -(-kb // -(-kb // sp)) == sp  # every split program has K blocks
            else:
                assert "split" not in c and c["BLOCK_M"] in (64, 128)
    calls = []  # the rules' knobs are what the kernel launches with no table
    monkeypatch.setattr(linear_triton, "_splitk_kernel", Recorder(linear_triton._splitk_kernel, calls))
    fp8_block_linear_triton(torch.randn(3, 256, generator=g), w, s)
    r = rules(N, 256, 3, sms)
    assert (calls[0]["SPLIT"], calls[0]["BLOCK_N"], calls[0]["num_warps"], calls[0]["num_stages"],
            calls[0]["PREFETCH"]) == (r["split"], r["BLOCK_N"], r["num_warps"], r["num_stages"], r["PREFETCH"])
    big = {"BLOCK_N": 256, "num_stages": 8, "BLOCK_M": 128}
    assert not fits(big, 4096) and big not in fine_space(dict(big, num_stages=3, GROUP_M=8, num_warps=4), 4096)


@pytest.mark.parametrize("M", [1, 16, 4096])
def test_the_search_finds_the_knobs_the_timer_favours(M):
    N, K, sms = 2112, 7168, 132
    coarse = [c for c in coarse_space(N, K, M, sms) if c["BLOCK_N"] == 64]
    best = next(d for d in fine_space(coarse[-1], M) if d["num_warps"] == 8 and d["num_stages"] == 4)
    seen = []
    seconds, knobs, n = search(favouring(best, seen), N, K, M, sms, deadline=time.monotonic() + 60)
    assert knobs == best and n == len(seen) == len({repr(sorted(c.items())) for c in seen})
    assert seconds == pytest.approx(1e-5)


def test_the_search_out_of_time_keeps_one_and_without_any_that_runs_raises():
    seen = []
    seconds, knobs, n = search(favouring(DECODE, seen), 2112, 7168, 1, 132, deadline=time.monotonic() - 1)
    assert n == 1 and knobs == seen[0] and seconds > 0
    with pytest.raises(RuntimeError, match="no configuration"):
        search(lambda knobs: None, 2112, 7168, 1, 132, deadline=time.monotonic() + 60)


# ---- specmla tune's plumbing -----------------------------------------------------------------------------------
def fp8_config(**overrides) -> ModelConfig:
    return ModelConfig.from_dict(dict(V3_BASE, model_type="deepseek_v3", quantization_config=FP8_QUANTIZATION,
                                      **overrides))


def test_the_models_fp8_linear_shapes():
    cfg = fp8_config(num_nextn_predict_layers=1)  # its eh_proj [64, 128] stays bf16 in DeepSeek's checkpoints
    H, q, kv, nope, rope, v, heads = 64, 48, 32, 16, 16, 24, 4
    assert set(linear_shapes(cfg)) == {(q, H), (heads * (nope + rope), q), (kv + rope, H), (H, heads * v),
                                       (96, H), (H, 96)}  # no kv_b_proj (dequantised at load), no head
    assert linear_keys(cfg)[0] == f"{q},{H}"
    bf16 = ModelConfig.from_dict(dict(V3_BASE, model_type="deepseek_v3"))
    assert linear_shapes(bf16) == []
    with pytest.raises(ValueError, match="not FP8"):
        tune_linear(bf16, "cpu", 1.0, timer_factory=lambda N, K, M: None, key="Fake_GPU")
    assert applicable_ops(cfg, ["decode", "moe", "fp8"]) == (["decode", "moe", "fp8"], {})
    dense = ModelConfig.from_dict(dict(V3_BASE, model_type="deepseek_v3", n_routed_experts=None))
    ops, why = applicable_ops(dense, ["moe", "fp8", "decode"])
    assert ops == ["decode"] and set(why) == {"moe", "fp8"} and "routed experts" in why["moe"]


def test_tune_linear_merges_into_the_users_table_and_out(tuned_tables, tmp_path):
    """Measured rows go to the user's table (a copy of the shipped one: its other shapes stay, a measured shape's
    old rows go) and to --out; the table then serves each bucket."""
    user, shipped = tuned_tables
    cfg = fp8_config()
    stale = linear_keys(cfg)[0]
    tuned.write("fp8_linear", "Fake_GPU", {"11,13": [[1, DECODE]], stale: [[2, DECODE]]}, folder=shipped / "fp8_linear")
    best = dict(DECODE, split=1, PREFETCH=4)
    written = tune_linear(cfg, "cpu", 5.0, out=str(tmp_path / "out"), key="Fake_GPU", sms=132,
                          timer_factory=lambda N, K, M: favouring(best if M <= 64 else GEMM))
    assert written == [user / "fp8_linear" / "Fake_GPU.json", tmp_path / "out" / "fp8_linear" / "Fake_GPU.json"]
    rows = tuning._rows("Fake_GPU", tuned.generation())
    assert rows["11,13"] == [(1, DECODE)]
    for key in linear_keys(cfg):
        assert [m for m, _ in rows[key]] == [1, 4, 16, 64, 256, 1024, 4096]
        assert tuning.pick(rows[key], 3) == best and tuning.pick(rows[key], 2000)["BLOCK_M"] == 64
    assert tuned.load_file(written[1]) == tuned.load_file(written[0])


def test_tune_shapes_reports_each_point(tuned_tables):
    report = []
    rows, rep = tune_shapes([(200, 300), (200, 300)], [1, 256], 2.0, torch.device("cpu"), sms=132,
                            timer_factory=lambda N, K, M: favouring(DECODE if M <= 64 else GEMM),
                            on_bucket=report.append)
    assert list(rows) == ["200,300"] and [m for m, _ in rows["200,300"]] == [1, 256]
    assert rep == report and [(r["N"], r["K"], r["M"]) for r in rep] == [(200, 300, 1), (200, 300, 256)]
    assert all(r["us"] > 0 and r["timed"] >= 1 and r["GBps"] > 0 for r in rep)
