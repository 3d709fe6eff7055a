"""A tensor-parallel rank's shard of the model: heads and MLP columns split, experts divided; FP8 weights with
their block scales."""

import pytest
import torch

from helpers.fp8_checkpoint import fp8_checkpoint_dir
from helpers.tiny_config import FP8_TP_TEST_CONFIG
from specmla.config import ModelConfig
from specmla.model.deepseek import DeepseekForCausalLM, MoE
from specmla.model.default import build_random_model_dir, init_random_
from specmla.model.fp8 import Fp8Linear, quantize_fp8_
from specmla.model.loader import load_model
from specmla.model.sharding import shard_model_


def test_shards_split_heads_and_experts(tiny_model_dir):
    full = load_model(tiny_model_dir, device="cpu", progress=False)
    part = load_model(tiny_model_dir, device="cpu", progress=False)
    shard_model_(part, 1, 2)
    a_full, a_part = full.model.layers[0].self_attn, part.model.layers[0].self_attn
    assert a_part.num_heads == a_full.num_heads // 2
    assert a_part.kv_b_proj.weight.shape[0] == a_full.kv_b_proj.weight.shape[0] // 2
    assert a_part.o_proj.weight.shape[1] == a_full.o_proj.weight.shape[1] // 2
    moe, whole = part.model.layers[1].mlp, full.model.layers[1].mlp
    assert moe.local_experts == (2, 4)
    assert torch.equal(moe.w_down, whole.w_down[2:4]) and torch.equal(moe.w_gate_up, whole.w_gate_up[2:4])
    Is = whole.shared_down.shape[1]
    assert moe.shared_down.shape == (whole.shared_down.shape[0], Is // 2)
    gate_up = whole.shared_gate_up
    assert torch.equal(moe.shared_gate_up, torch.cat([gate_up[Is // 2:Is], gate_up[Is + Is // 2:]]))
    views = moe.checkpoint_tensors()
    assert set(views) >= {"experts.2.down_proj.weight", "experts.3.gate_proj.weight"}
    # the shared experts' views cover this rank's slice: gate and up rows apart, down columns
    assert torch.equal(views["shared_experts.gate_proj.weight"], gate_up[Is // 2:Is])
    assert torch.equal(views["shared_experts.up_proj.weight"], gate_up[Is + Is // 2:])
    assert torch.equal(views["shared_experts.down_proj.weight"], whole.shared_down[:, Is // 2:])
    with pytest.raises(ValueError, match="heads"):
        shard_model_(load_model(tiny_model_dir, device="cpu", progress=False), 0, 3)


def test_load_model_with_shard_gives_the_shard_only(tiny_model_dir):
    """A tensor-parallel rank loads its shard (staged on the host): the same tensors as cutting the
    full model, and fewer parameters than the full model."""
    full = load_model(tiny_model_dir, device="cpu", progress=False)
    cut = load_model(tiny_model_dir, device="cpu", progress=False)
    shard_model_(cut, 1, 2)
    rank1 = load_model(tiny_model_dir, device="cpu", progress=False, shard=(1, 2))
    want, got = dict(cut.named_parameters()), dict(rank1.named_parameters())
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert sum(p.numel() for p in got.values()) < sum(p.numel() for p in full.parameters())


COLUMN_PARALLEL = ("q_proj", "q_b_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa")


@pytest.fixture(scope="module", params=[144, None], ids=["q_lora", "no_q_lora"])
def fp8_tp_dir(request, tmp_path_factory):
    """An FP8 checkpoint directory of FP8_TP_TEST_CONFIG (with and without q_lora_rank)."""
    base = tmp_path_factory.mktemp("fp8_tp")
    src = build_random_model_dir(base / "src", dict(FP8_TP_TEST_CONFIG, q_lora_rank=request.param), seed=3)
    return fp8_checkpoint_dir(src, base / "fp8")


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and (
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else torch.equal(a, b))


def test_fp8_shards_hold_slices_of_the_weights_and_scales_and_sum_to_the_full_layers(fp8_tp_dir):
    """TP=2 of an FP8 checkpoint: each rank's e4m3 weights and fp32 block scales are its slices of the full model's
    (column-parallel rows, row-parallel columns, replicated layers whole, its experts, its shared-expert columns), and
    the ranks' partial outputs of every row-parallel layer and every MoE layer sum to the full layer's output."""
    full = load_model(fp8_tp_dir, device="cpu", progress=False)
    parts = [load_model(fp8_tp_dir, device="cpu", progress=False, shard=(r, 2)) for r in range(2)]
    g = torch.Generator().manual_seed(0)
    linears = [(n, m) for n, m in full.named_modules() if isinstance(m, Fp8Linear)]
    assert {n.rsplit(".", 1)[1] for n, _ in linears} >= {"o_proj", "down_proj", "gate_proj", "up_proj"}
    for name, whole in linears:
        kind = name.rsplit(".", 1)[1]
        shards = [p.get_submodule(name) for p in parts]
        x = torch.randn(5, whole.in_features, generator=g)
        with torch.no_grad():
            want = whole(x)
            for r, s in enumerate(shards):
                assert isinstance(s, Fp8Linear), name
                if kind in REPLICATED:
                    assert _same(s.weight, whole.weight) and _same(s.weight_scale_inv, whole.weight_scale_inv)
                elif kind in COLUMN_PARALLEL:
                    assert _same(s.weight, whole.weight.chunk(2, 0)[r]), name
                    assert _same(s.weight_scale_inv, whole.weight_scale_inv.chunk(2, 0)[r]), name
                    assert s.out_features == whole.out_features // 2
                    torch.testing.assert_close(s(x), want.chunk(2, 1)[r])
                else:
                    assert kind in ROW_PARALLEL, name
                    assert _same(s.weight, whole.weight.chunk(2, 1)[r]), name
                    assert _same(s.weight_scale_inv, whole.weight_scale_inv.chunk(2, 1)[r]), name
                    assert s.in_features == whole.in_features // 2
            if kind in ROW_PARALLEL:
                got = sum(s(xr) for s, xr in zip(shards, x.chunk(2, 1)))
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    moes = [(n, m) for n, m in full.named_modules() if isinstance(m, MoE)]
    assert len(moes) == 2  # the trunk's and the MTP layer's
    for name, whole in moes:
        shards = [p.get_submodule(name) for p in parts]
        H, Isp = whole.shared_down.shape
        for r, s in enumerate(shards):
            e = slice(2 * r, 2 * r + 2)
            assert s.local_experts == (e.start, e.stop) and s.inter_padded == whole.inter_padded == 128
            for attr in ("w_gate_up", "w_down", "w_gate_up_scale", "w_down_scale"):
                assert _same(getattr(s, attr), getattr(whole, attr)[e]), (name, attr)
            i, b = slice(128 * r, 128 * r + 128), slice(r, r + 1)  # shared columns, their scale blocks
            assert s.shared_inter == 128 and s.shared_down.shape == (H, 128)
            assert _same(s.shared_gate_up, whole.shared_gate_up.view(2, Isp, H)[:, i].flatten(0, 1))
            assert _same(s.shared_gate_up_scale, whole.shared_gate_up_scale.view(2, Isp // 128, -1)[:, b].flatten(0, 1))
            assert _same(s.shared_down, whole.shared_down[:, i])
            assert _same(s.shared_down_scale, whole.shared_down_scale[:, b])
            views, full_views = s.checkpoint_tensors(), whole.checkpoint_tensors()
            assert _same(views["shared_experts.up_proj.weight"], full_views["shared_experts.up_proj.weight"][i])
            assert _same(views[f"experts.{e.start + 1}.down_proj.weight"],
                         full_views[f"experts.{e.start + 1}.down_proj.weight"])
            before = {n: p.clone() for n, p in s.named_parameters()}
            s.zero_padding_()  # the shard's padding is where zero_padding_ looks for it: nothing else changes
            assert all(_same(p, before[n]) for n, p in s.named_parameters())
        x = torch.randn(9, H, generator=g)
        with torch.no_grad():  # no process group: each shard returns its partial sum
            torch.testing.assert_close(shards[0](x) + shards[1](x), whole(x), rtol=1e-5, atol=1e-5)


def test_fp8_splits_off_the_128_blocks_are_refused_with_the_layer_named(fp8_tp_dir):
    """FP8 cuts must fall on scale blocks: TP=4 gives each rank 64 rows of the 256-row q projection (refused, naming
    it, its width and the TP size; weights='dequantize' loads); shared experts 64 wide split into 32 columns too.
    One rank keeps the whole model, the shared experts' padding (64 → 128) included."""
    fp8 = load_model(fp8_tp_dir, device="cpu", progress=False)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_(b_)?proj: FP8 width 256 .*tensor_parallel_size=4"
                                         r".*weights='dequantize'"):
        shard_model_(fp8, 0, 4)
    deq = load_model(fp8_tp_dir, device="cpu", progress=False, shard=(3, 4), weights="dequantize")
    assert deq.model.layers[0].self_attn.num_heads == 1
    cfg = ModelConfig.from_dict(dict(FP8_TP_TEST_CONFIG, n_shared_experts=1, num_nextn_predict_layers=0))
    model = quantize_fp8_(init_random_(DeepseekForCausalLM(cfg), std=0.05))
    before = {n: p.clone() for n, p in model.named_parameters()}
    shard_model_(model, 0, 1)
    assert all(_same(p, before[n]) for n, p in model.named_parameters())
    assert model.model.layers[1].mlp.shared_inter == 64
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.shared_experts: FP8 width 64 .*tensor_parallel_size=2"):
        shard_model_(model, 1, 2)


def test_a_rank_reads_only_its_part_of_the_checkpoint(fp8_tp_dir, monkeypatch):
    """load_model(shard=...) cuts the model on the meta device and reads each tensor as the rank's part: its own
    experts' tensors only, the rows or columns of a cut tensor only (kv_b_proj, dequantised at load, whole and then
    cut), every tensor once; the result equals cutting the fully loaded model."""
    from specmla.model import loader

    whole, part = [], []
    get, get_part = loader._get, loader._get_part
    monkeypatch.setattr(loader, "_get", lambda f, name, file: whole.append(name) or get(f, name, file))
    monkeypatch.setattr(loader, "_get_part", lambda f, name, file, *a: part.append((name, a)) or get_part(
        f, name, file, *a))
    rank1 = load_model(fp8_tp_dir, device="cpu", progress=False, shard=(1, 2))
    read = [n for n in whole + [n for n, _ in part] if not n.endswith("kv_b_proj.weight_scale_inv")]
    assert sorted(read) == sorted(rank1.checkpoint_tensors())  # each tensor the shard holds, once (+ kv_b's scales)
    assert not any(".experts.0." in n or ".experts.1." in n for n in read)  # rank 0's experts (of 4)
    assert any(".experts.3." in n for n in read)
    cut = {n for n, _ in part}
    assert any(n.endswith("o_proj.weight") for n in cut) and any(n.endswith("o_proj.weight_scale_inv") for n in cut)
    assert not any("kv_b_proj" in n for n in cut) and any("kv_b_proj.weight" in n for n in whole)
    assert all(a[1] > 0 for _, a in part)  # rank 1's parts start past rank 0's
    monkeypatch.undo()
    full = load_model(fp8_tp_dir, device="cpu", progress=False)
    shard_model_(full, 1, 2)
    want, got = dict(full.named_parameters()), dict(rank1.named_parameters())
    assert want.keys() == got.keys()
    for name in want:
        assert _same(got[name], want[name]), name
