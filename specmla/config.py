"""Model and engine configuration.

`ModelConfig` reads an HF `config.json` of the DeepSeek-V2/V3 family (V2, V2-Lite, V3/R1,
Moonlight, Kimi-K2 all use these two schemas) and normalises the differences between them and
between transformers versions (`rope_scaling` + `rope_theta` in real checkpoints,
`rope_parameters` in configs written by transformers >= 5).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


class UnsupportedModelError(ValueError):
    """The checkpoint is not a model family specmla can run."""


FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}  # DeepSeek-V3 / R1 / Kimi-K2 as published


def _quantization(qc: dict | None) -> str | None:
    """config.json's quantization_config → "fp8" (DeepSeek's block-scaled e4m3 weights, `FP8_QUANTIZATION`) or
    None; any other method, format, activation scheme or block size is refused with what is supported. Other keys
    (V3.1's scale_fmt "ue8m0": its fp32 scales are powers of two) do not change how the weights are read: which
    layers are FP8 follows the checkpoint's tensors (a weight with a `_scale_inv`)."""
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise UnsupportedModelError(f"quantization_config must be an object, got {qc!r}")
    got = {key: qc.get(key, FP8_QUANTIZATION[key] if key != "quant_method" else None) for key in FP8_QUANTIZATION}
    if isinstance(got["weight_block_size"], (list, tuple)):
        got["weight_block_size"] = list(got["weight_block_size"])
    bad = {key: value for key, value in got.items() if value != FP8_QUANTIZATION[key]}
    if bad:
        raise UnsupportedModelError(
            f"quantization_config {bad} is not supported: specmla loads bf16/fp32 checkpoints and DeepSeek's "
            f"block-scaled FP8 ones ({FP8_QUANTIZATION})")
    return "fp8"


class ConfigError(ValueError):
    """A config.json that cannot be read or parsed, or lacks a required key; the message names the file."""


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN attention-temperature factor (DeepSeek's `yarn_get_mscale`)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def cos_sin_scale(self) -> float:
        """YaRN's factor on cos/sin, as transformers computes it.

        Differs from DeepSeek's original code only when `mscale` is absent but `mscale_all_dim`
        is set (original: mscale(f, 1) / mscale(f, all_dim); transformers: mscale(f)); no
        released checkpoint is in that case.
        """
        if self.type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "RopeConfig":
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rtype = params.get("rope_type", params.get("type", "default")) or "default"
        if rtype not in ("default", "yarn"):
            raise UnsupportedModelError(f"rope type {rtype!r} is not supported (only default and yarn)")
        factor = params.get("factor")
        orig = params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096))
        if rtype == "yarn" and factor is None:
            factor = cfg["max_position_embeddings"] / orig
        return cls(
            theta=float(theta),
            type=rtype,
            factor=float(factor or 1.0),
            original_max_position_embeddings=int(orig),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )


@dataclass
class ModelConfig:
    model_type: str = "deepseek_v3"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int | None = 256
    n_shared_experts: int | None = 1
    num_experts_per_tok: int | None = 8
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    n_group: int | None = 8
    topk_group: int | None = 4
    topk_method: str = "noaux_tc"  # V3: noaux_tc; V2: greedy | group_limited_greedy
    scoring_func: str = "sigmoid"  # V3: sigmoid; V2: softmax
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    rope_interleave: bool = True
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    torch_dtype: str | None = None
    quantization: str | None = None  # "fp8": DeepSeek's block-scaled e4m3 linear weights (`_quantization`)

    # ---- derived -----------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached token: [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(d_qk), times mscale(factor, mscale_all_dim)^2 under YaRN (both V2 and V3)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope.type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            bool(self.n_routed_experts)
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    # ---- loading -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        arch_types = [SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES]
        if arch_types:
            model_type = arch_types[0]
        elif model_type in ("kimi_k2",):
            model_type = "deepseek_v3"
        if model_type not in ("deepseek_v2", "deepseek_v3"):
            raise UnsupportedModelError(
                f"unsupported architecture {archs or model_type!r}: specmla runs "
                f"{sorted(SUPPORTED_ARCHITECTURES)} checkpoints"
            )
        quantization = _quantization(cfg.get("quantization_config"))
        v2 = model_type == "deepseek_v2"
        heads = cfg["num_attention_heads"]
        if cfg.get("num_key_value_heads", heads) not in (None, heads):
            raise UnsupportedModelError("MLA models have num_key_value_heads == num_attention_heads")
        get = cfg.get
        positions = get("max_position_embeddings", 4096)
        if type(positions) is not int or positions < 2:  # a prompt token and one to generate, at the least
            raise ValueError(f"max_position_embeddings must be an integer >= 2, got {positions!r}")
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            moe_intermediate_size=get("moe_intermediate_size", 1407 if v2 else 2048),
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            q_lora_rank=get("q_lora_rank"),
            kv_lora_rank=get("kv_lora_rank", 512),
            qk_nope_head_dim=get("qk_nope_head_dim", 128),
            qk_rope_head_dim=get("qk_rope_head_dim", 64),
            v_head_dim=get("v_head_dim", 128),
            n_routed_experts=get("n_routed_experts"),
            n_shared_experts=get("n_shared_experts"),
            num_experts_per_tok=get("num_experts_per_tok"),
            first_k_dense_replace=get("first_k_dense_replace", 0),
            moe_layer_freq=get("moe_layer_freq", 1),
            n_group=get("n_group"),
            topk_group=get("topk_group"),
            topk_method=get("topk_method") or ("greedy" if v2 else "noaux_tc"),
            scoring_func=get("scoring_func") or ("softmax" if v2 else "sigmoid"),
            norm_topk_prob=bool(get("norm_topk_prob", not v2)),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0 if v2 else 2.5)),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            hidden_act=get("hidden_act", "silu"),
            attention_bias=bool(get("attention_bias", False)),
            rope_interleave=bool(get("rope_interleave", True)),
            rope=RopeConfig.from_hf(cfg),
            max_position_embeddings=positions,
            num_nextn_predict_layers=get("num_nextn_predict_layers", 0) or 0,
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            bos_token_id=get("bos_token_id"),
            eos_token_id=get("eos_token_id"),
            torch_dtype=get("torch_dtype") or get("dtype"),
            quantization=quantization,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e.strerror or e}") from e
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path} holds a JSON {type(cfg).__name__}, not an object")
        try:
            return cls.from_dict(cfg)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{path}: {e}") from e
        except KeyError as e:
            raise ConfigError(f"{path} lacks the key {e.args[0]!r}") from e
        except (TypeError, ValueError, AttributeError) as e:  # a value of the wrong type or shape
            raise ConfigError(f"{path} has an invalid value: {e}") from e
