"""The fused MoE's tile search (`ops.moe.tune`) with a stand-in timer (the GPU timer is `OpTimer`): it finds the
configuration the timer favours, keeps a sound one when out of time, and `specmla tune`'s plumbing writes rows
that `tuning.lookup` then serves per token bucket; the shipped rows of other shapes survive."""

import time

import pytest
import torch

from specmla.config import FP8_QUANTIZATION, ModelConfig
from specmla.ops import tuned
from specmla.ops.moe import tuning
from specmla.ops.moe.tune import BUCKETS, Search, coarse_space, feasible, fine_space, merge_rows
from specmla.ops.moe.tuning import Config, shape_key
from specmla.tune import moe_shape, tune_moe


def favouring(best_up: Config, best_down: Config, seen=None):
    """A timer whose fastest pair is (best_up, best_down): each field away from them costs more."""
    def dist(a: Config, b: Config) -> float:
        return sum(abs(x - y) / max(x, y) for x, y in zip(a.to_dict().values(), b.to_dict().values()))

    def timer(up: Config, down: Config) -> float:
        if seen is not None:
            seen.append((up, down))
        return 1e-5 * (1 + dist(up, best_up) + dist(down, best_down))
    return timer


@pytest.mark.parametrize("T", [1, 32, 512])
def test_the_search_finds_the_configuration_the_timer_favours(T):
    k, E = 6, 64
    bm = 16 if T <= 32 else 32  # at T = 32, 3 rows an expert: 16-row blocks only
    up = next(c for c in coarse_space("up", T, bm, k, E) if c.block_n == 128 and c.block_k == 64)
    up = next((c for c in fine_space("up", up) if c.num_stages == 3), up)
    down = next(c for c in coarse_space("down", T, bm, k, E) if c.block_n == 64 and c.block_k == 128)
    assert feasible("up", up) and feasible("down", down)
    r = Search(favouring(up, down), T, k, E, deadline=time.monotonic() + 60).run()
    assert (r["block_m"], r["up"], r["down"]) == (bm, up, down)
    assert r["seconds"] == pytest.approx(1e-5) and r["timed"] > 10


def test_out_of_time_it_keeps_a_sound_configuration_and_failures_are_skipped():
    seen = []
    timer = favouring(Config(64, 64, 64, 8, 4, 4), Config(64, 128, 64, 8, 4, 4), seen)
    failing = lambda up, down: None if up.block_n == 256 else timer(up, down)  # noqa: E731
    r = Search(failing, 512, 6, 64, deadline=time.monotonic() - 1).run()  # no time at all
    assert feasible("up", r["up"]) and feasible("down", r["down"]) and r["up"].block_m == r["down"].block_m
    assert r["timed"] <= 8 and r["up"].block_n != 256
    with pytest.raises(RuntimeError, match="no configuration ran"):
        Search(lambda up, down: None, 8, 6, 64, deadline=time.monotonic() + 5).run()


def test_merge_rows_replaces_buckets_and_keeps_them_sorted():
    table = {"up,8,32,64": [[8, Config(16, 32, 32).to_dict()], [128, Config(64, 64, 64).to_dict()]]}
    merge_rows(table, "up,8,32,64", [(32, Config(32, 64, 64)), (8, Config(16, 64, 64))])
    assert [m for m, _ in table["up,8,32,64"]] == [8, 32, 128]
    assert table["up,8,32,64"][0][1]["block_n"] == 64


def test_specmla_tune_writes_rows_that_lookup_serves_and_keeps_the_shipped_ones(tuned_tables, tmp_path, monkeypatch):
    user, shipped = tuned_tables
    key = "FAKE_GPU"
    other = {shape_key("up", 256, 2048, 7168): [[1, Config(16, 128, 128, 1, 4, 4).to_dict()]]}
    tuned.write("moe", key, other, folder=shipped / "moe")
    cfg = ModelConfig.from_dict({"model_type": "deepseek_v2", "vocab_size": 300, "hidden_size": 64,
                                 "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "kv_lora_rank": 64, "qk_nope_head_dim": 16,
                                 "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8,
                                 "num_experts_per_tok": 2, "n_shared_experts": 2, "first_k_dense_replace": 1})
    assert moe_shape(cfg) == (8, 2, 64, 32, 64)
    want = {T: (Config(16 if T < 128 else 64, 32, 64, 1, 4, 2), Config(16 if T < 128 else 64, 64, 32, 1, 4, 3))
            for T in BUCKETS}
    written = tune_moe(cfg, torch.device("cpu"), budget_s=30, out=str(tmp_path / "ship"), key=key,
                       timer_factory=lambda T: favouring(*want[T]))
    assert written == [user / "moe" / f"{key}.json", tmp_path / "ship" / "moe" / f"{key}.json"]
    monkeypatch.setattr(tuned, "cuda_device_key", lambda device: key)
    for T in BUCKETS:
        for kind, n, kk, cfg_want in (("up", 32, 64, want[T][0]), ("down", 64, 32, want[T][1])):
            got = tuning.lookup(kind, 8, n, kk, T, torch.device("cpu"), top_k=2)
            assert got.block_m == cfg_want.block_m, (kind, T)
    assert tuning.lookup("up", 256, 2048, 7168, 1, torch.device("cpu")) == Config(16, 128, 128, 1, 4, 4)


def test_tune_refuses_what_it_cannot_search():
    dense = ModelConfig.from_dict({"model_type": "deepseek_v2", "vocab_size": 300, "hidden_size": 64,
                                   "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "kv_lora_rank": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
                                   "v_head_dim": 16, "n_routed_experts": None})
    with pytest.raises(ValueError, match="no routed experts"):
        tune_moe(dense, torch.device("cpu"), 1.0, key="X", timer_factory=lambda T: None)


def test_fp8_experts_search_the_tiles_their_kernels_take(tuned_tables, monkeypatch):
    """An FP8 checkpoint's MoE is searched as "up_fp8" / "down_fp8" at the stacks' widths (padded to 128): block_k
    128 everywhere, gate‖up's block_n 128, e4m3 shared memory; the rows land where `tuning.lookup` reads them."""
    cfg = ModelConfig.from_dict({"model_type": "deepseek_v3", "vocab_size": 300, "hidden_size": 64,
                                 "intermediate_size": 96, "moe_intermediate_size": 96, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48,
                                 "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
                                 "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                                 "first_k_dense_replace": 1, "quantization_config": FP8_QUANTIZATION})
    assert moe_shape(cfg) == (8, 2, 64, 128, 128)
    for T in (1, 64, 2048):
        up, down = coarse_space("up_fp8", T, 32, 2, 8), coarse_space("down_fp8", T, 32, 2, 8)
        assert up and {(c.block_n, c.block_k) for c in up} == {(128, 128)}
        assert {c.block_n for c in down} == {32, 64, 128, 256} and {c.block_k for c in down} == {128}
    assert not feasible("up_fp8", Config(32, 64, 128)) and not feasible("down_fp8", Config(32, 64, 64))
    wide = Config(128, 128, 128, 8, 8, 4)  # 196 KB of e4m3 stages, twice that in bf16
    assert feasible("up_fp8", wide) and not feasible("up", wide)
    want = {T: (Config(16 if T < 128 else 64, 128, 128, 1, 8, 3), Config(16 if T < 128 else 64, 64, 128, 1, 4, 4))
            for T in BUCKETS}
    seen = []
    tune_moe(cfg, torch.device("cpu"), budget_s=30, key="FAKE_GPU", timer_factory=lambda T: favouring(*want[T], seen))
    assert seen and all(up.block_k == down.block_k == 128 and up.block_n == 128 for up, down in seen)
    monkeypatch.setattr(tuned, "cuda_device_key", lambda device: "FAKE_GPU")
    for T in BUCKETS:
        assert tuning.lookup("up_fp8", 8, 128, 64, T, torch.device("cpu"), top_k=2) == want[T][0], T
        assert tuning.lookup("down_fp8", 8, 64, 128, T, torch.device("cpu"), top_k=2) == want[T][1], T
