"""Measured tables (`ops.tuned`): the user's file, then the shipped one, then the rules; SPECMLA_TUNING picks the
sources; a rewritten file is read again; a broken one is a clear error; a table only ever changes tiles and
kernels, never results (the fused MoE under the interpreter, driven by a user's table, equals its oracle)."""

import json

import pytest
import torch
from helpers.moe_cases import make_moe_case, moe_oracle, rel_err

from specmla.ops import tuned
from specmla.ops.decode import dispatch
from specmla.ops.moe import tuning
from specmla.ops.moe.triton import fused_moe_triton
from specmla.ops.moe.tuning import Config, shape_key

KEY = "FAKE_GPU_80GB"


def _moe_table(block_m: int) -> dict:
    cfg = Config(block_m, 32, 32, 1, 4, 2).to_dict()
    return {shape_key("up", 7, 48, 64): [[1 << 20, cfg]], shape_key("down", 7, 64, 48): [[1 << 20, cfg]]}


def test_the_user_file_then_the_shipped_file_then_the_rules(tuned_tables, monkeypatch):
    user, shipped = tuned_tables
    assert tuned.source("moe", KEY) is None and tuned.load("moe", KEY) == {}
    ship = tuned.write("moe", KEY, _moe_table(16), folder=shipped / "moe")
    assert tuned.source("moe", KEY) == ship
    mine = tuned.write("moe", KEY, _moe_table(32))
    assert mine == user / "moe" / f"{KEY}.json" and tuned.source("moe", KEY) == mine
    assert tuned.source("moe", None) is None  # not a CUDA device: the rules
    monkeypatch.setenv("SPECMLA_TUNING", "shipped")
    assert tuned.source("moe", KEY) == ship
    monkeypatch.setenv("SPECMLA_TUNING", "rules")
    assert tuned.source("moe", KEY) is None
    monkeypatch.setenv("SPECMLA_TUNING", "fastest")
    with pytest.raises(ValueError, match="SPECMLA_TUNING"):
        tuned.source("moe", KEY)
    with pytest.raises(ValueError, match="unknown tuned table"):
        tuned.user_file("prefill", KEY)


def test_a_rewritten_file_is_read_again_and_a_broken_one_is_a_clear_error(tuned_tables):
    """`write` makes the process read the table again; a file changed behind its back is read after
    `clear_cache()`, and a broken one names itself."""
    path = tuned.write("moe", KEY, _moe_table(16))
    assert tuning._table(KEY)[shape_key("up", 7, 48, 64)][0][1].block_m == 16
    tuned.write("moe", KEY, _moe_table(64))
    assert tuning._table(KEY)[shape_key("up", 7, 48, 64)][0][1].block_m == 64
    path.write_text("{not json")  # written behind the process's back: seen once the caches are cleared
    assert tuning._table(KEY)[shape_key("up", 7, 48, 64)][0][1].block_m == 64
    tuned.clear_cache()
    with pytest.raises(ValueError, match=str(path)):
        tuning._table(KEY)


def test_decode_routes_come_from_the_users_file(tuned_tables):
    routes = {"bf16,1,16": [[4, 8192, "triton"]]}
    tuned.write("decode_routes", KEY, {"device": "fake", "routes": routes})
    assert dispatch.load_routes(KEY) == routes
    assert dispatch.load_routes(None) == {}


def test_a_users_moe_table_changes_the_tiles_not_the_result(tuned_tables, monkeypatch):
    """The fused MoE on the CPU (interpreter) with the device key faked: each table's block_m reaches the kernel
    (seen through `lookup`) and every result equals the oracle within the untuned test's tolerance."""
    case = make_moe_case(40, 7, 3, 64, 48, 56, torch.float32, seed=5)
    oracle = moe_oracle(*case.args, shared=case.shared)
    monkeypatch.setattr(tuned, "cuda_device_key", lambda device: KEY)
    seen = []
    lookup = tuning.lookup
    monkeypatch.setattr("specmla.ops.moe.triton.lookup", lambda *a, **k: seen.append(lookup(*a, **k)) or seen[-1])
    for block_m in (16, 32, 64):
        tuned.write("moe", KEY, _moe_table(block_m))
        got = fused_moe_triton(*case.args, shared=case.shared)
        assert seen[-1].block_m == block_m and seen[-2].block_m == block_m
        assert rel_err(got, oracle) <= 1e-5


def test_shipped_tables_parse():
    """Every shipped table reads, and its MoE rows are Configs in increasing token buckets."""
    for path in tuned.SHIPPED["moe"].glob("*.json"):
        for key, rows in tuning._table(path.stem).items():
            assert [m for m, _ in rows] == sorted(m for m, _ in rows), key
    for path in tuned.SHIPPED["decode_routes"].glob("*.json"):
        assert json.loads(path.read_text())["routes"]
    from specmla.ops.linear import tuning as linear_tuning

    for path in tuned.SHIPPED["fp8_linear"].glob("*.json"):  # every row passes the kernels' checks
        table = json.loads(path.read_text())
        assert table
        for key, rows in table.items():
            got = [linear_tuning.check_row(row, f"{path} [{key}]") for row in rows]
            assert [m for m, _ in got] == sorted(m for m, _ in got), key
