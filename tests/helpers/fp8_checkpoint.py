"""Test-side FP8 checkpoints: an HF checkpoint directory rewritten as DeepSeek publishes V3 / R1 / Kimi-K2 — every
linear weight of the layers (attention projections, dense MLP, routed and shared experts) block-quantised to
float8_e4m3fn with an fp32 `weight_scale_inv` per 128 × 128 block (`weight_quant`, the inverse of DeepSeek's
`weight_dequant`), the rest (embedding, head, norms, router, `e_score_correction_bias`, MTP's eh_proj and head) as
it was, and `quantization_config` in config.json. `dequantized_dir` writes the oracle's view of such a directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from specmla.config import FP8_QUANTIZATION
from specmla.model.loader import save_tensors
from specmla.ops.linear.reference import weight_dequant, weight_quant

KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "eh_proj", "shared_head")


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
        ["model.safetensors"]
    out = {}
    for fname in files:
        with safe_open(str(path / fname), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def _copy_side_files(src: Path, dst: Path) -> dict:
    """Copy src's files other than the weights, their index and config.json to dst; return src's config."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("model.safetensors.index.json",
                                                                         "config.json"):
            shutil.copy(f, dst / f.name)
    return json.loads((src / "config.json").read_text())


def quantized(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and not any(k in name for k in KEEP)


def fp8_checkpoint_dir(src: Path, dst: Path, shard_bytes: int = 200_000) -> Path:
    """src (an HF checkpoint directory) rewritten at dst as an FP8 block-scaled checkpoint."""
    cfg = _copy_side_files(src, dst)
    out = {}
    for name, t in read_checkpoint(src).items():
        if quantized(name, t):
            out[name], out[name + "_scale_inv"] = weight_quant(t)
        else:
            out[name] = t
    save_tensors(out, dst, shard_bytes)
    cfg["quantization_config"] = dict(FP8_QUANTIZATION)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def dequantized_dir(src: Path, dst: Path, dtype: torch.dtype = torch.float32) -> Path:
    """An FP8 checkpoint directory as plain `dtype` weights (weight · scale per block): what the oracle loads."""
    cfg = _copy_side_files(src, dst)
    tensors = read_checkpoint(src)
    out = {name: (weight_dequant(t, tensors[name + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t.float())
               .to(dtype) for name, t in tensors.items() if not name.endswith("_scale_inv")}
    save_tensors(out, dst, 10 ** 12)
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst
