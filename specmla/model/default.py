"""The default model for `LLM()` / `specmla generate` when no model is named.

The trained embedded model ships in `specmla/assets/` (scripts/train_tiny.py). If those files are
missing (e.g. a trimmed install), a tiny *randomly initialised* DeepSeek-V3-shaped model
(production latent shapes: kv_lora_rank 512, rope dims 64, one MoE layer, one MTP layer) with a
byte-level tokenizer is written once to `$SPECMLA_CACHE` (default ~/.cache/specmla) and used
instead: it runs every code path but its text is noise. Tests use it as a small fixture.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from specmla.config import ModelConfig
from specmla.model.deepseek import DeepseekForCausalLM
from specmla.model.loader import save_checkpoint

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TINY_RANDOM_NAME = "tiny-random-v1"

TINY_RANDOM_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 259,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rope_theta": 10000.0,
    "rope_interleave": True,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]


def cache_dir() -> Path:
    return Path(os.environ.get("SPECMLA_CACHE", Path.home() / ".cache" / "specmla"))


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer with no merges: 256 byte tokens + 3 specials (ids 256..258)."""
    vocab = {c: i for i, c in enumerate(_chars_in_byte_order())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(path / "tokenizer.json"))
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2],
                   "add_bos_token": True, "add_eos_token": False, "model_max_length": 2048}, f, indent=1)


def _chars_in_byte_order() -> list[str]:
    """GPT-2's bytes_to_unicode characters, listed by the byte each one stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def build_random_model_dir(path: Path, config: dict | None = None, seed: int = 0) -> Path:
    """Write config.json, model.safetensors (random weights) and a byte tokenizer to `path`."""
    config = dict(config or TINY_RANDOM_CONFIG)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = ModelConfig.from_dict(config)
    model = init_random_(DeepseekForCausalLM(cfg), std=0.05)
    save_checkpoint(model, path)
    with open(path / "config.json", "w") as f:
        json.dump(config, f, indent=1)
    write_byte_tokenizer(path)
    return path


def init_random_(model: DeepseekForCausalLM, std: float, generator: torch.Generator | None = None
                 ) -> DeepseekForCausalLM:
    """Random weights in place: norm weights 1, every other parameter N(0, std²) (from `generator`, else the
    global generator). Returns the model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=generator)
    return model


def default_model_path() -> Path:
    if (ASSETS / "config.json").exists():
        return ASSETS
    path = cache_dir() / TINY_RANDOM_NAME
    if not (path / "model.safetensors").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        build_random_model_dir(tmp)
        if not path.exists():
            tmp.rename(path)
    return path
