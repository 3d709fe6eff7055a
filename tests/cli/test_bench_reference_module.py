"""The module benchmark's DeepSeek-reference-style MLA computes what specmla's module computes."""

import sys
from pathlib import Path

import torch
from helpers.mla_cases import rel_err

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_reference_style_module_equals_specmla_module():
    import bench_prefill as bp

    import specmla.model.deepseek as ds
    from specmla.config import ModelConfig
    from specmla.model.metadata import AttentionMetadata

    cfg = ModelConfig.from_dict({
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 10, "hidden_size": 96, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 3, "q_lora_rank": None, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 8, "max_position_embeddings": 64,
    })
    torch.manual_seed(0)
    attn = ds.MLAttention(cfg)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.1)
        B, L = 2, 11
        x = torch.randn(B, L, 96)
        ours = attn(x.view(B * L, -1), AttentionMetadata.for_contiguous([L] * B), bp.ds_cos_sin(cfg, L, "cpu"), None)
        ref = bp.ReferenceMLA(attn)(x, torch.arange(L).repeat(B))
    assert rel_err(ours.view(B, L, -1), ref) < 1e-5
