"""benchmarks/step_profile.py: every kernel a decode step launches falls in a named group, and a profile of the tiny
model on the CPU adds up (groups = kernels = the profiled time, the requests gone after)."""

import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import step_profile as sp  # noqa: E402

from specmla import LLM, SamplingParams  # noqa: E402

# kernels that never run in a decode step (prompt attention, the n-gram proposer, tensor-parallel reductions)
NOT_IN_A_DECODE_STEP = {"_prefill_kernel", "_mla_prefill_ws_kernel", "_ngram_search_kernel", "_ngram_budget_kernel",
                        "_one_shot_all_reduce_kernel"}


def _launched_kernels() -> set[str]:
    """Names of the Triton / Gluon kernels in specmla.ops that a launch names (the *_kernel functions)."""
    import specmla.ops

    names = set()
    for mod in pkgutil.walk_packages(specmla.ops.__path__, "specmla.ops."):
        module = importlib.import_module(mod.name)
        for attr, value in vars(module).items():
            fn = getattr(value, "fn", None)  # a JITFunction wraps the Python function
            if attr.endswith("_kernel") and callable(fn) and getattr(fn, "__module__", None) == mod.name:
                names.add(attr)
    return names


def test_every_decode_step_kernel_has_a_group():
    names = _launched_kernels()
    assert {"_gate_up_kernel", "_down_kernel", "_rms_norm_kernel", "_mla_decode_seesaw_kernel",
            "_mla_decode_combine_kernel", "_moe_route_kernel"} <= names  # the scan sees the ops' kernels
    ungrouped = sorted(n for n in names - NOT_IN_A_DECODE_STEP if sp.group_of(n) == sp.OTHER)
    assert not ungrouped, f"kernels a step may launch that the profile would call '{sp.OTHER}': {ungrouped}"
    assert sp.group_of("_gate_up_fp8_kernel") == "MoE gate‖up" and sp.group_of("_down_fp8_kernel") == "MoE down"
    assert sp.group_of("_mla_decode_combine_kernel") == "MLA combine + rotation"
    assert sp.group_of("sm90_xmma_gemm_bf16bf16_bf16f32") == sp.group_of("aten::mm") == "GEMM / GEMV (cuBLAS, aten)"
    assert sp.group_of("aten::mmx") == sp.OTHER


def test_a_cpu_profile_adds_up_and_leaves_the_engine_idle(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=256)
    res = sp.profile_decode(llm, 3, prompt_len=11, floor_s=1e-3, steps=3, warm=1)
    assert not llm.engine.has_unfinished()
    assert res["batch"] == 3 and res["step_s"] > 0 and res["kernels"]
    total = sum(k["us_per_step"] for k in res["kernels"])
    assert total == pytest.approx(res["busy_us_per_step"]) == pytest.approx(sum(g["us_per_step"]
                                                                                  for g in res["groups"]))
    assert sum(g["calls_per_step"] for g in res["groups"]) == pytest.approx(sum(k["calls_per_step"]
                                                                              for k in res["kernels"]))
    gemm = next(g for g in res["groups"] if g["group"] == "GEMM / GEMV (cuBLAS, aten)")
    assert gemm["calls_per_step"] >= 2 * llm.model.config.num_hidden_layers  # projections of every layer
    for row in res["groups"] + res["kernels"]:
        assert row["step_share"] == pytest.approx(row["us_per_step"] / (res["step_s"] * 1e6))
        assert row["floor_share"] == pytest.approx(row["us_per_step"] / 1e3)
    table = sp.format_profile(res)
    assert "| GEMM / GEMV (cuBLAS, aten) |" in table and "B=3, 11-token prompts" in table
    params = SamplingParams(max_tokens=2, temperature=0)
    assert len(llm.generate([[5, 6, 7]], params)[0].token_ids) == 2  # the engine still serves
    llm.engine.add_request([5, 6, 7], params)
    with pytest.raises(RuntimeError, match="idle engine"):
        sp.profile_decode(llm, 1, prompt_len=4, floor_s=1e-3, steps=1)
