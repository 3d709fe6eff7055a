"""The config of the small random test model that `tiny_model_dir` builds (fast on CPU)."""

TINY_TEST_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 259,
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 64,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_theta": 10000.0, "max_position_embeddings": 512,
    "num_nextn_predict_layers": 1, "bos_token_id": 256, "eos_token_id": 257, "torch_dtype": "float32",
}

# An FP8-checkpoint variant whose TP=2 cuts fall on 128-blocks: q_b_proj rows and o_proj columns 2 heads × 64, the
# dense MLP 256, the shared experts 4 × 64 = 256; hidden 160 (partial edge blocks), routed experts 64 wide (padded
# to 128 in the FP8 stacks)
FP8_TP_TEST_CONFIG = dict(TINY_TEST_CONFIG, hidden_size=160, intermediate_size=256, moe_intermediate_size=64,
                          q_lora_rank=144, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64, n_shared_experts=4)
