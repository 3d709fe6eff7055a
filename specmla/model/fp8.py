"""DeepSeek's FP8 checkpoints in the model: linear layers whose checkpoint weight is float8_e4m3fn with a
`weight_scale_inv` keep it so (`Fp8Linear`, `ops.fp8_block_linear`), the MoE stacks too (`MoE.use_fp8_`).

What stays in the model dtype: every tensor the checkpoint keeps unquantised (embedding, head, norms, the
router, `e_score_correction_bias`) and kv_b_proj, dequantised at load (`loader`): the absorbed decode folds its
W_UK / W_UV blocks into the queries and the output per head (`MLAttention.absorbed_weights`), which takes them
as 16-bit matrices, and it is about 0.15 % of a V3 layer's weight bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from specmla.model.deepseek import MoE
from specmla.ops.linear import fp8_block_linear
from specmla.ops.linear.reference import BLOCK

DEQUANTISED_AT_LOAD = ("kv_b_proj",)  # linear layers that stay in the model dtype (see the module docstring)


class Fp8Linear(nn.Module):
    """y = x @ (weight · scale)ᵀ (+ bias) with weight float8_e4m3fn [out, in] and weight_scale_inv fp32
    [⌈out/128⌉, ⌈in/128⌉] (the checkpoint's names); the output has x's dtype. No gradients."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(-(-out_features // BLOCK), -(-in_features // BLOCK), dtype=torch.float32, device=device),
            requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_block_linear(x, self.weight, self.weight_scale_inv, bias=self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block {BLOCK}"


def use_fp8_weights_(model: nn.Module, fp8_names: set[str], checkpoint_name) -> list[str]:
    """Turn the model's linear layers and MoE stacks into their FP8 form where the checkpoint has `<weight>_scale_inv`
    for them (`fp8_names`: the checkpoint's tensor names; `checkpoint_name(param name)` maps a parameter name to
    the checkpoint's), except `DEQUANTISED_AT_LOAD`. Works on the meta device; returns the converted modules'
    names."""
    converted = []
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, nn.Linear) and name not in DEQUANTISED_AT_LOAD and not (tied and full == "lm_head"):
                if checkpoint_name(full + ".weight") + "_scale_inv" in fp8_names:
                    setattr(parent, name, Fp8Linear(child.in_features, child.out_features, child.bias is not None,
                                                    device=child.weight.device, dtype=child.weight.dtype))
                    converted.append(full)
            elif isinstance(child, MoE):
                first = next(iter(child.checkpoint_tensors()))  # the first routed expert's gate_proj.weight
                if checkpoint_name(f"{full}.{first}") + "_scale_inv" in fp8_names:
                    child.use_fp8_()
                    converted.append(full)
    return converted
