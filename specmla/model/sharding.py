"""Cut a loaded `DeepseekForCausalLM` down to one tensor-parallel rank's shard (in place).

Layout for rank r of `world`:
- attention: q_proj / q_b_proj and kv_b_proj split by heads (column-parallel), o_proj split by its
  input columns (row-parallel) with an all-reduce; q_a / kv_a replicated, so the latent c_kv is the
  same on every rank and each rank keeps a full copy of the paged latent cache while its decode
  kernel sees H/world heads;
- dense MLP: gate/up column-parallel, down row-parallel, all-reduce;
- MoE: expert-parallel: rank r keeps and computes the routed experts [r·E/world, (r+1)·E/world)
  (routing is replicated, so every rank agrees on it) plus its column/row slice of the shared
  experts; one all-reduce sums the partial outputs;
- embedding and head replicated; MTP modules sharded like the trunk.
The layers do their all-reduce themselves (`tp_reduce`), through `specmla.distributed`.

FP8 weights (`model.fp8`) are cut with their block scales: every cut of an `Fp8Linear` or of the shared
experts' FP8 stacks falls on a 128-block boundary (else ValueError: such a model loads with
weights="dequantize"), so each rank's weight and scales are slices of the full ones. The routed experts'
stacks are cut along the expert axis only, scales alike.
"""

from __future__ import annotations

import torch
from torch import nn

from specmla.model.deepseek import MLP, DeepseekForCausalLM, MLAttention, MoE
from specmla.model.fp8 import Fp8Linear
from specmla.ops.linear.reference import BLOCK


def _param(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(t.clone(memory_format=torch.contiguous_format), requires_grad=like.requires_grad)


def _blocks(start: int, end: int, width: int, what: str, world: int) -> slice:
    """The scale blocks of an FP8 weight's cut [start, end) of `width`; start and end fall on block boundaries (end
    may be the full width, whose last block is partial)."""
    if start % BLOCK or (end % BLOCK and end != width):
        raise ValueError(f"{what}: FP8 width {width} does not split over tensor_parallel_size={world} on "
                         f"{BLOCK}-wide scale blocks (a rank gets [{start}, {end})): load with weights='dequantize'")
    return slice(start // BLOCK, -(-end // BLOCK))


def _rows(linear: nn.Module, start: int, end: int, name: str, world: int) -> None:
    """Keep output rows [start, end) of an nn.Linear or Fp8Linear (column-parallel)."""
    if isinstance(linear, Fp8Linear):
        s = linear.weight_scale_inv
        linear.weight_scale_inv = _param(s.data[_blocks(start, end, linear.out_features, name, world)], s)
    linear.weight = _param(linear.weight.data[start:end], linear.weight)
    if linear.bias is not None:
        linear.bias = _param(linear.bias.data[start:end], linear.bias)
    linear.out_features = end - start


def _cols(linear: nn.Module, start: int, end: int, rank: int, name: str, world: int) -> None:
    """Keep input columns [start, end) of an nn.Linear or Fp8Linear (row-parallel); the bias stays on rank 0 only."""
    if isinstance(linear, Fp8Linear):
        s = linear.weight_scale_inv
        linear.weight_scale_inv = _param(s.data[:, _blocks(start, end, linear.in_features, name, world)], s)
    linear.weight = _param(linear.weight.data[:, start:end], linear.weight)
    linear.in_features = end - start
    if linear.bias is not None and rank != 0:  # the bias is added once, after the sum
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=linear.bias.requires_grad)


def shard_model_(model: DeepseekForCausalLM, rank: int, world: int) -> None:
    """Cut a fully loaded model down to rank's shard (in place)."""
    cfg = model.config
    H = cfg.num_attention_heads
    if H % world:
        raise ValueError(f"{H} heads do not split over tensor_parallel_size={world}")
    h0, h1 = H * rank // world, H * (rank + 1) // world
    for name, module in model.named_modules():
        if isinstance(module, MLAttention):
            qk, kvd = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
            q = "q_proj" if cfg.q_lora_rank is None else "q_b_proj"
            _rows(getattr(module, q), h0 * qk, h1 * qk, f"{name}.{q}", world)
            _rows(module.kv_b_proj, h0 * kvd, h1 * kvd, f"{name}.kv_b_proj", world)
            _cols(module.o_proj, h0 * cfg.v_head_dim, h1 * cfg.v_head_dim, rank, f"{name}.o_proj", world)
            module.num_heads = h1 - h0
            module.tp_reduce = True
        elif isinstance(module, MoE):
            _split_moe(module, rank, world, name)
        elif isinstance(module, MLP):
            _split_mlp(module, rank, world, name)
            module.tp_reduce = True


def _split_moe(moe: MoE, rank: int, world: int, name: str = "MoE") -> None:
    """Keep experts [r·E/world, (r+1)·E/world) and the column slice r of the shared experts (errors name the layer
    `name`).

    The shared experts' stacks hold gate‖up [2·Isp, H] and down [H, Isp] with the real width Is = shared_inter
    padded to Isp (FP8: a multiple of 128; else Isp = Is). Rank r keeps real columns [i0, i1) of Is, and with
    them the padding when i1 = Is, so its stacks are laid out as `MoE.use_fp8_` lays out a width of i1 − i0:
    padded to a multiple of 128, zero past i1 − i0."""
    E = moe.w_down.shape[0]
    if E % world:
        raise ValueError(f"{E} experts do not split over tensor_parallel_size={world}")
    e0, e1 = E * rank // world, E * (rank + 1) // world
    for attr in ("w_gate_up", "w_down", "w_gate_up_scale", "w_down_scale"):
        t = getattr(moe, attr)
        if t is not None:
            setattr(moe, attr, _param(t.data[e0:e1], t))
    moe.local_experts = (e0, e1)
    moe.tp_reduce = True
    if moe.shared_down is None:
        return
    Is, Isp = moe.shared_inter, moe.shared_down.shape[1]
    if Is % world:
        raise ValueError(f"{name}: shared expert width {Is} does not split over tensor_parallel_size={world}")
    i0, i1 = Is * rank // world, Is * (rank + 1) // world
    p1 = Isp if i1 == Is else i1  # the last rank keeps the padding
    gu, down = moe.shared_gate_up, moe.shared_down
    moe.shared_gate_up = _param(torch.cat([gu.data[i0:p1], gu.data[Isp + i0:Isp + p1]]), gu)
    moe.shared_down = _param(down.data[:, i0:p1], down)
    if moe.shared_down_scale is not None:
        b = _blocks(i0, i1, Is, f"{name}.shared_experts", world)  # ends at Isp / 128 when i1 = Is
        nb = Isp // BLOCK  # scale rows of the gate (and of the up) projection
        gs, ds = moe.shared_gate_up_scale, moe.shared_down_scale
        moe.shared_gate_up_scale = _param(torch.cat([gs.data[b], gs.data[nb + b.start:nb + b.stop]]), gs)
        moe.shared_down_scale = _param(ds.data[:, b], ds)
    moe.shared_inter = i1 - i0


def _split_mlp(mlp: MLP, rank: int, world: int, name: str = "MLP") -> None:
    inter = mlp.gate_proj.out_features
    if inter % world:
        raise ValueError(f"{name}: intermediate size {inter} does not split over tensor_parallel_size={world}")
    i0, i1 = inter * rank // world, inter * (rank + 1) // world
    _rows(mlp.gate_proj, i0, i1, f"{name}.gate_proj", world)
    _rows(mlp.up_proj, i0, i1, f"{name}.up_proj", world)
    _cols(mlp.down_proj, i0, i1, rank, f"{name}.down_proj", world)
