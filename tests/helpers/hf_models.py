"""Tiny random DeepSeek-V2/V3 models built with transformers (the test oracle) and saved to disk."""

from __future__ import annotations

import torch

V3_BASE = dict(
    vocab_size=211, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
    v_head_dim=24, qk_nope_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)
V2_BASE = dict(
    vocab_size=199, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
    v_head_dim=24, qk_nope_head_dim=16, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3,
    first_k_dense_replace=1, routed_scaling_factor=1.0, topk_method="greedy", norm_topk_prob=False,
    max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)
YARN = {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}

CONFIGS = {
    "v3_qlora_groups": ("v3", dict(V3_BASE)),
    "v3_no_qlora_yarn": ("v3", dict(V3_BASE, q_lora_rank=None, rope_scaling=dict(YARN), n_group=4, topk_group=2)),
    "v3_no_interleave_dense_first2": ("v3", dict(V3_BASE, rope_interleave=False, first_k_dense_replace=2, n_group=1, topk_group=1)),
    "v2_lite_greedy": ("v2", dict(V2_BASE)),
    "v2_group_limited_yarn_qlora": ("v2", dict(V2_BASE, q_lora_rank=40, topk_method="group_limited_greedy", n_group=4,
                                              topk_group=2, routed_scaling_factor=16.0, rope_scaling=dict(YARN))),
}


def build_hf_model(kind: str, overrides: dict, seed: int = 0, std: float = 0.08):
    """Random fp32 transformers model; weights drawn with a larger std than HF's default so that
    logits are far from ties, router bias randomised so that it matters."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    if kind == "v3":
        cfg = DeepseekV3Config(**overrides)
        model = DeepseekV3ForCausalLM(cfg)
    else:
        cfg = DeepseekV2Config(**overrides)
        model = DeepseekV2ForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return model.eval().float()


def save_hf_model(model, path, max_shard_size="200KB", mtp_layers: int = 0, seed: int = 0):
    """save_pretrained (sharded), optionally appending random MTP layers as model.layers.{N+i}.*."""
    model.save_pretrained(path, max_shard_size=max_shard_size)
    if mtp_layers:
        import json

        from safetensors.torch import save_file

        from safetensors import safe_open

        cfg = model.config
        N, hid = cfg.num_hidden_layers, cfg.hidden_size
        g = torch.Generator().manual_seed(seed + 7)
        with open(f"{path}/model.safetensors.index.json") as f:
            weight_map = json.load(f)["weight_map"]
        sd = {}  # the checkpoint as written (per-expert tensors, whatever the in-memory layout)
        for name, fname in weight_map.items():
            with safe_open(f"{path}/{fname}", framework="pt") as f:
                sd[name] = f.get_tensor(name)
        extra = {}
        for i in range(mtp_layers):
            src = f"model.layers.{N - 1}."  # copy the shapes of the last (MoE) layer
            for name, t in sd.items():
                if name.startswith(src):
                    extra[f"model.layers.{N + i}." + name[len(src):]] = 0.08 * torch.randn(t.shape, generator=g)
            pre = f"model.layers.{N + i}."
            extra[pre + "enorm.weight"] = 1 + 0.1 * torch.randn(hid, generator=g)
            extra[pre + "hnorm.weight"] = 1 + 0.1 * torch.randn(hid, generator=g)
            extra[pre + "eh_proj.weight"] = 0.08 * torch.randn(hid, 2 * hid, generator=g)
            extra[pre + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(hid, generator=g)
            extra[pre + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
            extra[pre + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
        save_file({k: v.contiguous() for k, v in extra.items()}, f"{path}/mtp.safetensors")
        idx_path = f"{path}/model.safetensors.index.json"
        with open(idx_path) as f:
            idx = json.load(f)
        idx["weight_map"].update({k: "mtp.safetensors" for k in extra})
        with open(idx_path, "w") as f:
            json.dump(idx, f)
        with open(f"{path}/config.json") as f:
            c = json.load(f)
        c["num_nextn_predict_layers"] = mtp_layers
        with open(f"{path}/config.json", "w") as f:
            json.dump(c, f)
    return path
