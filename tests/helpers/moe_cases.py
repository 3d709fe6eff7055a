"""A small random MoE layer of the DeepSeek-V2 or V3 routing kind, for the model's and the kernels' tests."""

import torch

from specmla.config import ModelConfig
from specmla.model.deepseek import MoE


def make_moe(kind: str, seed: int = 0) -> MoE:
    cfg = ModelConfig.from_dict({
        "architectures": ["DeepseekV3ForCausalLM" if kind == "v3" else "DeepseekV2ForCausalLM"],
        "vocab_size": 10, "hidden_size": 48, "intermediate_size": 64, "moe_intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 2, "n_routed_experts": 12, "n_shared_experts": 1,
        "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 0,
        "topk_method": "noaux_tc" if kind == "v3" else "group_limited_greedy",
    })
    torch.manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        if moe.gate.e_score_correction_bias is not None:
            moe.gate.e_score_correction_bias.normal_(0, 0.1)
    return moe
