"""`fuse_input_projections_`: q_proj (q_a_proj) and kv_a_proj_with_mqa as one GEMM at inference, on CPU: the
forward equals the unfused model's, the parameters keep their identity and share the fused storage (edits and
loads reach the fused GEMM), training takes the two modules, FP8 fuses weights and block scales where the first
part ends on a scale block and refuses otherwise."""

import pytest
import torch
from helpers.tiny_config import FP8_TP_TEST_CONFIG, TINY_TEST_CONFIG

from specmla.config import ModelConfig
from specmla.model.deepseek import DeepseekForCausalLM
from specmla.model.default import init_random_
from specmla.model.fp8 import quantize_fp8_
from specmla.model.metadata import AttentionMetadata


def _model(cfg: dict, seed: int = 0) -> DeepseekForCausalLM:
    torch.manual_seed(seed)
    return init_random_(DeepseekForCausalLM(ModelConfig.from_dict(cfg)), std=0.05)


def _hidden(model, ids):
    meta = AttentionMetadata.for_contiguous([ids.shape[0]], device=ids.device)
    with torch.no_grad():
        return model(ids, meta)


def _ids(vocab: int, n: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("q_lora_rank", [None, 48])
def test_fused_forward_equals_the_two_modules(q_lora_rank):
    cfg = dict(TINY_TEST_CONFIG, q_lora_rank=q_lora_rank)
    model = _model(cfg)
    ids = _ids(cfg["vocab_size"])
    want = _hidden(model, ids)
    attn = model.model.layers[0].self_attn
    first = attn.q_proj if q_lora_rank is None else attn.q_a_proj
    params = (first.weight, attn.kv_a_proj_with_mqa.weight)
    values = [p.detach().clone() for p in params]
    assert model.fuse_input_projections_() == len(model.model.layers) + len(model.mtp)
    assert first.weight is params[0] and attn.kv_a_proj_with_mqa.weight is params[1]  # the same parameters
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    fused = attn.input_proj_weight
    assert fused.shape == (first.out_features + attn.kv_a_proj_with_mqa.out_features, cfg["hidden_size"])
    assert params[0].data_ptr() == fused.data_ptr()  # views of the fused storage
    got = _hidden(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert "input_proj_weight" not in model.state_dict()  # not a checkpoint tensor


def test_edits_after_fusing_reach_the_fused_gemm():
    model, reference = _model(TINY_TEST_CONFIG), _model(TINY_TEST_CONFIG)
    ids = _ids(TINY_TEST_CONFIG["vocab_size"])
    model.fuse_input_projections_()
    with torch.no_grad():
        for m in (model, reference):  # a load after fusing copies into the parameters
            m.model.layers[1].self_attn.kv_a_proj_with_mqa.weight.mul_(1.5)
            m.model.layers[0].self_attn.q_proj.weight.add_(0.01)
    torch.testing.assert_close(_hidden(model, ids), _hidden(reference, ids), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(_hidden(model, ids), _hidden(_model(TINY_TEST_CONFIG), ids), atol=1e-3)


def test_training_takes_the_two_modules():
    model = _model(TINY_TEST_CONFIG)
    model.fuse_input_projections_()
    ids = _ids(TINY_TEST_CONFIG["vocab_size"])
    meta = AttentionMetadata.for_contiguous([ids.shape[0]], device=ids.device)
    model(ids, meta).square().sum().backward()
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.grad is not None and attn.q_proj.weight.grad.abs().sum() > 0
    assert attn.kv_a_proj_with_mqa.weight.grad.abs().sum() > 0


def test_fp8_fuses_weights_and_scales_on_whole_blocks():
    cfg = dict(FP8_TP_TEST_CONFIG, q_lora_rank=128, n_shared_experts=1)
    model = quantize_fp8_(_model(cfg))
    ids = _ids(cfg["vocab_size"])
    want = _hidden(model, ids)
    attn = model.model.layers[0].self_attn
    assert attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    assert model.fuse_input_projections_() == len(model.model.layers) + len(model.mtp)
    assert attn.input_proj_weight.dtype == torch.float8_e4m3fn
    assert attn.input_proj_scale.shape[0] == 1 + attn.kv_a_proj_with_mqa.weight_scale_inv.shape[0]
    assert attn.q_a_proj.weight_scale_inv.data_ptr() == attn.input_proj_scale.data_ptr()
    torch.testing.assert_close(_hidden(model, ids), want, rtol=1e-5, atol=1e-6)


def test_fp8_off_the_scale_blocks_and_biased_projections_stay_apart():
    model = quantize_fp8_(_model(dict(FP8_TP_TEST_CONFIG, n_shared_experts=1)))  # q_lora_rank 144: 1.125 blocks
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert model.fuse_input_projections_() == 0
    assert not hasattr(model.model.layers[0].self_attn, "input_proj_weight")
    assert all(torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                           before[n].view(torch.uint8) if p.dtype == torch.float8_e4m3fn else before[n])
               for n, p in model.named_parameters())
    biased = _model(dict(TINY_TEST_CONFIG, q_lora_rank=48, attention_bias=True))
    assert biased.fuse_input_projections_() == 0
