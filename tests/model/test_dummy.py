"""Random weights of a config's shapes (`load_format="dummy"`): the tensors a checkpoint would fill, each from a
generator seeded by its name; the rank's shard only; FP8 where DeepSeek's FP8 checkpoints quantise."""

import json

import pytest
import torch

from helpers.tiny_config import FP8_TP_TEST_CONFIG
from specmla.config import FP8_QUANTIZATION, ModelConfig
from specmla.model.deepseek import RMSNorm
from specmla.model.dummy import dummy_model
from specmla.model.fp8 import Fp8Linear, quantize_fp8_
from specmla.model.loader import CheckpointError, empty_model, load_model

CFG = FP8_TP_TEST_CONFIG  # widths over 128: the FP8 blocks have full and partial edges


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _params(model):
    return dict(model.named_parameters())


def test_dummy_model_has_the_checkpoint_shapes_norms_of_one_and_seeded_values():
    cfg = ModelConfig.from_dict(CFG)
    model = dummy_model(cfg, "cpu", torch.float32)
    ref = empty_model(cfg, "cpu", torch.float32)
    got, want = _params(model), _params(ref)
    assert got.keys() == want.keys()
    for name, p in got.items():
        assert p.shape == want[name].shape and p.dtype == want[name].dtype, name
        assert torch.isfinite(p).all(), name
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)
    w = model.model.layers[1].mlp.w_gate_up
    assert 0.015 < w.std().item() < 0.025 and abs(w.mean().item()) < 2e-3
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.zeros_like(bias))
    # the same seed gives the same weights; another seed other ones; distinct tensors are not copies of each other
    again, other = _params(dummy_model(cfg, "cpu", torch.float32)), _params(dummy_model(cfg, "cpu", torch.float32,
                                                                                        seed=1))
    assert all(torch.equal(got[n], again[n]) for n in got)
    q_b = "model.layers.0.self_attn.q_b_proj.weight"
    assert not torch.equal(got[q_b], other[q_b])
    assert not torch.equal(got["model.layers.0.self_attn.o_proj.weight"][:, :64],
                           got["model.layers.1.self_attn.o_proj.weight"][:, :64])
    assert torch.equal(model.cos_sin, ref.cos_sin)


def test_dummy_fp8_is_the_dummy_bf16_model_quantised_layer_by_layer():
    """Quantising each piece as it is built gives the bytes of quantising the whole random model at once."""
    cfg = ModelConfig.from_dict(CFG)
    fp8 = dummy_model(cfg, "cpu", torch.float32, fp8=True)
    whole = quantize_fp8_(dummy_model(cfg, "cpu", torch.float32))
    got, want = _params(fp8), _params(whole)
    assert got.keys() == want.keys()
    for name in got:
        assert got[name].dtype == want[name].dtype and torch.equal(_bits(got[name]), _bits(want[name])), name
    assert isinstance(fp8.model.layers[0].self_attn.q_b_proj, Fp8Linear)
    assert fp8.model.layers[1].mlp.w_gate_up.dtype == torch.float8_e4m3fn
    assert fp8.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.float32  # dequantised at load, as loaded


def test_dummy_shards_share_the_replicated_tensors_and_cut_the_rest():
    cfg = ModelConfig.from_dict(CFG)
    full = _params(dummy_model(cfg, "cpu", torch.float32))
    ranks = [_params(dummy_model(cfg, "cpu", torch.float32, shard=(r, 2))) for r in range(2)]
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"):
        assert torch.equal(ranks[0][name], full[name]) and torch.equal(ranks[1][name], full[name]), name
    q_b = "model.layers.0.self_attn.q_b_proj.weight"
    assert ranks[0][q_b].shape[0] == full[q_b].shape[0] // 2
    assert ranks[0]["model.layers.1.mlp.w_down"].shape[0] == CFG["n_routed_experts"] // 2


def test_load_model_dummy_reads_config_json_only(tmp_path):
    cfg = dict(CFG, quantization_config=FP8_QUANTIZATION, num_hidden_layers=3)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_model(tmp_path, device="cpu", load_format="dummy", progress=False)
    assert len(model.model.layers) == 3 and len(model.mtp) == 1  # no checkpoint to drop the MTP layer for
    assert isinstance(model.model.layers[2].self_attn.o_proj, Fp8Linear)
    plain = load_model(tmp_path, device="cpu", load_format="dummy", weights="dequantize", progress=False)
    assert not any(p.dtype == torch.float8_e4m3fn for p in plain.parameters())
    with pytest.raises(ValueError, match="load_format"):
        load_model(tmp_path, device="cpu", load_format="pt", progress=False)
    with pytest.raises(CheckpointError, match="model.safetensors"):  # the default format needs the weights
        load_model(tmp_path, device="cpu", progress=False)
