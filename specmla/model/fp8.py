"""DeepSeek's FP8 checkpoints in the model: linear layers whose checkpoint weight is float8_e4m3fn with a
`weight_scale_inv` keep it so (`Fp8Linear`, `ops.fp8_block_linear`), the MoE stacks too (`MoE.use_fp8_`).

What stays in the model dtype: every tensor the checkpoint keeps unquantised (embedding, head, norms, the
router, `e_score_correction_bias`) and kv_b_proj, dequantised at load (`loader`): the absorbed decode folds its
W_UK / W_UV blocks into the queries and the output per head (`MLAttention.absorbed_weights`), which takes them
as 16-bit matrices, and it is a small part of a layer's weight bytes.

`use_fp8_numerics_` chooses what the FP8 layers run: the ops' "auto" (the w8a8 kernels on CUDA, the dequantised
reference on CPU) or "emulate" (the torch emulation of the kernels' w8a8 arithmetic, DeepSeek's act_quant
numerics, on any device).
"""

from __future__ import annotations

import torch
from torch import nn

from specmla.model.deepseek import MoE
from specmla.ops.linear import fp8_block_linear
from specmla.ops.linear.reference import BLOCK, weight_quant

DEQUANTISED_AT_LOAD = ("kv_b_proj",)  # linear layers that stay in the model dtype (see the module docstring)


class Fp8Linear(nn.Module):
    """y = x @ (weight · scale)ᵀ (+ bias) with weight float8_e4m3fn [out, in] and weight_scale_inv fp32
    [⌈out/128⌉, ⌈in/128⌉] (the checkpoint's names); the output has x's dtype. No gradients. `backend`: the
    `fp8_block_linear` backend it runs (`use_fp8_numerics_` sets it)."""

    backend = "auto"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(-(-out_features // BLOCK), -(-in_features // BLOCK), dtype=torch.float32, device=device),
            requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False) \
            if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_block_linear(x, self.weight, self.weight_scale_inv, bias=self.bias, backend=self.backend)

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


FP8_NUMERICS = {"auto": "auto", "emulate": "w8a8_torch"}  # fp8_numerics → the ops' backend of the FP8 layers


def check_fp8_numerics(numerics: str) -> str:
    """The ops' backend of fp8_numerics `numerics` (`FP8_NUMERICS`); ValueError naming the choices otherwise."""
    if numerics not in FP8_NUMERICS:
        raise ValueError(f"fp8_numerics={numerics!r}: expected one of {tuple(FP8_NUMERICS)}")
    return FP8_NUMERICS[numerics]


def use_fp8_numerics_(model: nn.Module, numerics: str) -> int:
    """Set the backend of every FP8 layer of `model` (`Fp8Linear`, MoE stacks in float8; the fused input projections
    follow their first `Fp8Linear`): numerics "auto" → the ops' "auto" (w8a8 kernels on CUDA, the dequantised
    reference on CPU), "emulate" → "w8a8_torch" (activations quantised per token per 128 columns as DeepSeek's
    act_quant, block-scaled weights, fp32 products; its MoE reads the chosen experts on the host, so it runs outside
    CUDA graphs). Returns how many layers it set; ValueError for another value, or "emulate" on a model without FP8
    layers."""
    backend = check_fp8_numerics(numerics)
    layers = [m for m in model.modules()
              if isinstance(m, Fp8Linear) or (isinstance(m, MoE) and m.w_gate_up_scale is not None)]
    if numerics == "emulate" and not layers:
        raise ValueError("fp8_numerics='emulate' needs FP8 layers: an FP8 checkpoint loaded with weights='auto'")
    for m in layers:
        m.backend = backend
    return len(layers)


def fp8_numerics_of(model: nn.Module) -> str:
    """The fp8_numerics `model` runs: "emulate" where any FP8 layer runs the w8a8 emulation (`use_fp8_numerics_`),
    else "auto"."""
    emulated = any(isinstance(m, (Fp8Linear, MoE)) and m.backend == FP8_NUMERICS["emulate"] for m in model.modules())
    return "emulate" if emulated else "auto"


# linear layers DeepSeek's FP8 checkpoints leave in bf16 or that load dequantised (embedding, head, norms and router
# are not nn.Linear layers of the decoder layers)
NOT_QUANTISED = DEQUANTISED_AT_LOAD + ("eh_proj",)


@torch.no_grad()
def quantize_fp8_(model: nn.Module, chunk: int = 16, prefix: str = "") -> nn.Module:
    """Block-quantise an in-memory model the way DeepSeek's FP8 checkpoints are (`weight_quant`): every linear layer
    of the decoder and MTP layers except `NOT_QUANTISED`, and the MoE stacks (padded as `MoE.use_fp8_` lays them
    out), on the weights' device, `chunk` experts at a time. For benchmarks of FP8 models too large to write to
    disk; returns the model. prefix: `model`'s own name in the whole model when it is a part of one (e.g.
    "model.layers.3"), which decides what is a decoder or MTP layer."""
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = ".".join(n for n in (prefix, parent_name, name) if n)
            in_layers = full.startswith(("model.layers.", "mtp."))
            if isinstance(child, nn.Linear) and in_layers and name not in NOT_QUANTISED:
                fp8 = Fp8Linear(child.in_features, child.out_features, child.bias is not None,
                                device=child.weight.device, dtype=child.weight.dtype)
                fp8.weight.data, fp8.weight_scale_inv.data = weight_quant(child.weight)
                if child.bias is not None:
                    fp8.bias.data.copy_(child.bias)
                setattr(parent, name, fp8)
            elif isinstance(child, MoE) and child.w_gate_up_scale is None:
                _quantize_moe_(child, chunk)
    return model


def _quantize_moe_(moe: MoE, chunk: int) -> None:
    gate_up, down = moe.w_gate_up.data, moe.w_down.data
    shared = None if moe.shared_down is None else (moe.shared_gate_up.data, moe.shared_down.data)
    I = moe.inter
    moe.use_fp8_()
    Ip = moe.inter_padded
    for e0 in range(0, down.shape[0], chunk):
        e1 = min(e0 + chunk, down.shape[0])
        gu = gate_up[e0:e1].view(e1 - e0, 2, I, -1)
        moe.w_gate_up.data[e0:e1], moe.w_gate_up_scale.data[e0:e1] = weight_quant(
            torch.nn.functional.pad(gu, (0, 0, 0, Ip - I)).flatten(1, 2))
        moe.w_down.data[e0:e1], moe.w_down_scale.data[e0:e1] = weight_quant(
            torch.nn.functional.pad(down[e0:e1], (0, Ip - I)))
    if shared is not None:
        gu, d = shared
        Is, Isp = moe.shared_inter, moe.shared_down.shape[1]
        moe.shared_gate_up.data, moe.shared_gate_up_scale.data = weight_quant(
            torch.nn.functional.pad(gu.view(2, Is, -1), (0, 0, 0, Isp - Is)).flatten(0, 1))
        moe.shared_down.data, moe.shared_down_scale.data = weight_quant(torch.nn.functional.pad(d, (0, Isp - Is)))
