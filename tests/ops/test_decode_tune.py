"""The decode routes' measurement (`ops.decode.tune`) with a stand-in timer (the GPU one is `kernel_times`): the
table names each point's fastest kernel, a run out of time leaves the rest to the rules and says so, and the
grid leaves out points whose caches would not fit; `dispatch.select_kernel` then follows the table."""

import time

import pytest

from specmla.ops.decode import dispatch
from specmla.ops.decode.tune import GRID_B, GRID_T, MAX_CACHE_BYTES, ROUTE_CANDIDATES, grid, row_bytes, tune_routes


def stand_in(kv, H, B, T, S):
    """Triton fastest at small B, the format's first Hopper kernel elsewhere."""
    first = ROUTE_CANDIDATES[kv][0]
    return {"triton": 1e-5 if B < 16 else 3e-5, first: 2e-5}


def test_the_table_names_each_points_fastest_kernel():
    pts = [(1, 2048), (64, 8192)]
    table = tune_routes(16, ["bf16", "fp8"], [1, 4], "cpu", budget_s=60, measure=stand_in, points=lambda kv: pts)
    assert sorted(table["routes"]) == ["bf16,1,16", "bf16,4,16", "fp8,1,16", "fp8,4,16"]
    assert table["routes"]["fp8,4,16"] == [[1, 2048, "triton"], [64, 8192, "fp8"]]
    assert table["us"]["bf16,1,16"][1] == [64, 8192, {"triton": 30.0, "bf16": 20.0}]
    assert table["points_left_to_rules"] == 0
    # the route table follows it: a bf16 call near (64, 8192) on Hopper takes the measured kernel
    route = dispatch.select_kernel(60, 1, 16, 576, "bf16", hopper=True, sm_count=132, max_seq=8000, elem=2,
                                   supports=lambda k, m: True, routes=table["routes"])
    assert route.kernel == "bf16"


def test_out_of_time_the_rest_is_left_to_the_rules():
    calls = []

    def slow(kv, H, B, T, S):
        calls.append((kv, S, B, T))
        time.sleep(0.05)
        return stand_in(kv, H, B, T, S)

    table = tune_routes(16, ["bf16"], [1, 2], "cpu", budget_s=0.01, measure=slow,
                        points=lambda kv: [(1, 2048), (4, 2048), (16, 2048)])
    assert len(calls) == 1 and table["points_left_to_rules"] == 5
    with pytest.raises(ValueError, match="cache format 'fp32'"):
        tune_routes(16, ["fp32"], [1], "cpu", 1.0, measure=stand_in, points=lambda kv: [(1, 2048)])


def test_the_grid_leaves_out_caches_that_would_not_fit():
    for kv in ROUTE_CANDIDATES:
        pts = grid(kv, l2_bytes=50 << 20)
        assert pts and set(pts) <= {(B, T) for B in GRID_B for T in GRID_T}
        assert all(B * T * row_bytes(kv) <= MAX_CACHE_BYTES for B, T in pts)
    assert len(grid("tbq4", l2_bytes=50 << 20)) >= len(grid("bf16", l2_bytes=50 << 20))  # smaller rows fit more


def test_specmla_tune_merges_measured_routes_over_the_shipped_ones(tuned_tables, tmp_path):
    from specmla.config import ModelConfig
    from specmla.ops import tuned
    from specmla.tune import tune_decode

    _, shipped_folder = tuned_tables
    key = "FAKE_GPU"
    shipped = {"routes": {"bf16,1,16": [[1, 4096, "bf16"]], "tbq4,1,128": [[8, 8192, "tbq4"]]}, "us": {}}
    tuned.write("decode_routes", key, shipped, folder=shipped_folder / "decode_routes")
    cfg = ModelConfig.from_dict({"model_type": "deepseek_v2", "vocab_size": 300, "hidden_size": 64,
                                 "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 16,
                                 "kv_lora_rank": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16})
    written = tune_decode(cfg, "cpu", ["bf16"], [1, 4], 60, out=str(tmp_path / "ship"), key=key, measure=stand_in,
                          points=lambda kv: [(1, 2048), (64, 8192)])
    assert written[1] == tmp_path / "ship" / "decode_routes" / f"{key}.json"
    routes = dispatch.load_routes(key)
    assert routes["bf16,1,16"] == [[1, 2048, "triton"], [64, 8192, "bf16"]]  # measured: replaced
    assert routes["bf16,4,16"] and routes["tbq4,1,128"] == [[8, 8192, "tbq4"]]  # new, and the shipped one kept
