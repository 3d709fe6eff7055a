import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU every Triton kernel runs in the interpreter (must be set before triton.jit runs).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers/ as the package `helpers`

torch.set_num_threads(min(2, os.cpu_count() or 1))

TINY_TEST_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 259,
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 64,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_theta": 10000.0, "max_position_embeddings": 512,
    "num_nextn_predict_layers": 1, "bos_token_id": 256, "eos_token_id": 257, "torch_dtype": "float32",
}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A small random model directory with a byte-level tokenizer (fast on CPU)."""
    from specmla.model.default import build_random_model_dir

    return build_random_model_dir(tmp_path_factory.mktemp("tiny") / "model", TINY_TEST_CONFIG, seed=0)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    os.environ["SPECMLA_CACHE"] = str(tmp_path_factory.mktemp("specmla_cache"))
