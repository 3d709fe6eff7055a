"""Random weights of a config's shapes, built on the device (vLLM's `load_format="dummy"`): for benchmarks of models
too large to write to disk, e.g. DeepSeek-V3 under tensor parallelism.

The model is built on the meta device and cut to the rank's shard there (`shard_model_`), then materialised one
piece (the embedding, each decoder or MTP layer, the head) at a time: random normal weights of std 0.02, norms 1,
router biases 0, and, for an FP8 config, the piece block-quantised in place (`quantize_fp8_`, QUANT_CHUNK experts at
a time) before the next one is allocated, so the peak is the rank's FP8 shard plus one bf16 piece and the
quantiser's fp32 temporaries of a few experts; on a GPU the cached free blocks go back before the KV pool is sized.
Each tensor's values come from a generator seeded by its name: replicated tensors are equal on every rank (routing
and sampling agree across ranks); a sharded tensor holds the same values on every rank, so a rank's shard is not a
slice of the TP = 1 model.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from specmla.config import ModelConfig
from specmla.model.deepseek import DeepseekForCausalLM, RMSNorm
from specmla.model.fp8 import quantize_fp8_
from specmla.model.rope import rope_cos_sin_cache
from specmla.model.sharding import shard_model_

STD = 0.02
QUANT_CHUNK = 4  # experts quantised together: their fp32 temporaries are ~5× their bf16 bytes


@torch.no_grad()
def dummy_model(cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype, max_positions: int | None = None,
                shard: tuple[int, int] | None = None, fp8: bool | None = None, seed: int = 0) -> DeepseekForCausalLM:
    """The model of `cfg` (rank shard[0] of shard[1] when given) with random weights on `device`. fp8: block-scaled
    e4m3 weights where DeepSeek's FP8 checkpoints have them (default: when cfg.quantization is "fp8")."""
    device = torch.device(device)
    fp8 = cfg.quantization == "fp8" if fp8 is None else fp8
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, max_positions=max_positions).to(dtype)
    if shard is not None:
        shard_model_(model, *shard)
    pieces = [("model.embed_tokens", model.model.embed_tokens), ("model.norm", model.model.norm)]
    pieces += [(f"model.layers.{i}", layer) for i, layer in enumerate(model.model.layers)]
    pieces += [(f"mtp.{i}", layer) for i, layer in enumerate(model.mtp)]
    if not cfg.tie_word_embeddings:
        pieces.append(("lm_head", model.lm_head))
    for prefix, piece in pieces:
        piece.to_empty(device=device)
        _fill_(piece, prefix, seed)
        if fp8 and prefix.startswith(("model.layers.", "mtp.")):
            quantize_fp8_(piece, chunk=QUANT_CHUNK, prefix=prefix)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.cos_sin = rope_cos_sin_cache(cfg.rope, cfg.qk_rope_head_dim, model.max_positions, device=device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model.eval()


def _fill_(piece: nn.Module, prefix: str, seed: int) -> None:
    """Norm weights 1, router biases 0 (fp32), every other parameter N(0, STD²) from a generator seeded by its name."""
    for module in piece.modules():
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        if getattr(module, "e_score_correction_bias", None) is not None:
            module.e_score_correction_bias = torch.zeros_like(module.e_score_correction_bias, dtype=torch.float32)
    norms = {id(m.weight) for m in piece.modules() if isinstance(m, RMSNorm)}
    for name, p in piece.named_parameters():
        if id(p) in norms:
            continue
        g = torch.Generator(device=p.device).manual_seed(zlib.crc32(f"{seed}:{prefix}.{name}".encode()))
        p.normal_(0.0, STD, generator=g)
