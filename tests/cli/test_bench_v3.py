"""bench_v3's CPU side: the memory plan (weights per rank, built on the meta device) is what `load_format="dummy"`
builds on a device, and one configuration's run reports the step, its floor and the MTP projection."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_v3 as bv  # noqa: E402

from helpers.tiny_config import FP8_TP_TEST_CONFIG  # noqa: E402
from specmla.config import FP8_QUANTIZATION, ModelConfig  # noqa: E402
from specmla.model.dummy import dummy_model  # noqa: E402

CFG = dict(FP8_TP_TEST_CONFIG, quantization_config=FP8_QUANTIZATION, torch_dtype="bfloat16")


def test_memory_plan_is_the_bytes_each_rank_builds():
    plan = {r["tp"]: r for r in bv.memory_plan(CFG, worlds=(1, 2))}
    for tp in (1, 2):
        shard = None if tp == 1 else (0, tp)
        model = dummy_model(ModelConfig.from_dict(CFG), "cpu", torch.bfloat16, shard=shard)
        assert plan[tp]["rank_bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan[2]["parts"]["routed experts"] * 2 == plan[1]["parts"]["routed experts"]
    assert plan[2]["parts"]["embedding + head"] == plan[1]["parts"]["embedding + head"]  # replicated
    assert plan[2]["rank_bytes"] < plan[1]["rank_bytes"]


def test_one_configuration_reports_step_floor_and_projection(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(CFG, torch_dtype="float32")))
    run = bv.run_config(tmp_path, 1, "auto", "mtp1", [1, 2], 12, 4, 1, 1e10, False)
    assert run["kv_bytes_per_token"] > 0 and [r["batch"] for r in run["rows"]] == [1, 2]
    for r in run["rows"]:
        assert r["step_s"] == r["per_token_s"] * r["acceptance_length"] and r["acceptance_length"] >= 1
        assert r["floor_s"] == (r["weight_bytes"] + r["kv_bytes"]) / 1e10 > 0
        p85, p90 = r["projected_tok_s"]["0.85"], r["projected_tok_s"]["0.9"]
        assert abs(p85 * r["step_s"] - 1.85) < 1e-9 and p90 > p85
