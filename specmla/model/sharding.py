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
"""

from __future__ import annotations

import torch
from torch import nn

from specmla.model.deepseek import MLP, DeepseekForCausalLM, MLAttention, MoE


def _rows(linear: nn.Linear, start: int, end: int) -> None:
    linear.weight = nn.Parameter(linear.weight.data[start:end].clone())
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[start:end].clone())
    linear.out_features = end - start


def _cols(linear: nn.Linear, start: int, end: int, rank: int) -> None:
    linear.weight = nn.Parameter(linear.weight.data[:, start:end].clone())
    linear.in_features = end - start
    if linear.bias is not None and rank != 0:  # the bias is added once, after the sum
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias))


def shard_model_(model: DeepseekForCausalLM, rank: int, world: int) -> None:
    """Cut a fully loaded model down to rank's shard (in place)."""
    cfg = model.config
    if any(p.dtype == torch.float8_e4m3fn for p in model.parameters()):
        raise ValueError("tensor parallelism of FP8 weights is not supported: load them with weights='dequantize'")
    H = cfg.num_attention_heads
    if H % world:
        raise ValueError(f"{H} heads do not split over tensor_parallel_size={world}")
    h0, h1 = H * rank // world, H * (rank + 1) // world
    for module in model.modules():
        if isinstance(module, MLAttention):
            qk, kvd = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
            _rows(module.q_proj if cfg.q_lora_rank is None else module.q_b_proj, h0 * qk, h1 * qk)
            _rows(module.kv_b_proj, h0 * kvd, h1 * kvd)
            _cols(module.o_proj, h0 * cfg.v_head_dim, h1 * cfg.v_head_dim, rank)
            module.num_heads = h1 - h0
            module.tp_reduce = True
        elif isinstance(module, MoE):
            _split_moe(module, rank, world)
    for layer in list(model.model.layers) + list(model.mtp):
        if isinstance(layer.mlp, MLP):
            _split_mlp(layer.mlp, rank, world)
            layer.mlp.tp_reduce = True


def _split_moe(moe: MoE, rank: int, world: int) -> None:
    """Keep experts [r·E/world, (r+1)·E/world) and the column slice r of the shared experts."""
    E = moe.w_down.shape[0]
    if E % world:
        raise ValueError(f"{E} experts do not split over tensor_parallel_size={world}")
    e0, e1 = E * rank // world, E * (rank + 1) // world
    moe.w_gate_up = nn.Parameter(moe.w_gate_up.data[e0:e1].clone())
    moe.w_down = nn.Parameter(moe.w_down.data[e0:e1].clone())
    moe.local_experts = (e0, e1)
    moe.tp_reduce = True
    if moe.shared_down is not None:
        Is = moe.shared_down.shape[1]
        if Is % world:
            raise ValueError(f"shared expert width {Is} does not split over tensor_parallel_size={world}")
        i0, i1 = Is * rank // world, Is * (rank + 1) // world
        gu = moe.shared_gate_up.data
        moe.shared_gate_up = nn.Parameter(torch.cat([gu[i0:i1], gu[Is + i0:Is + i1]]).contiguous())
        moe.shared_down = nn.Parameter(moe.shared_down.data[:, i0:i1].contiguous())
        moe.shared_inter = i1 - i0


def _split_mlp(mlp: MLP, rank: int, world: int) -> None:
    inter = mlp.gate_proj.out_features
    if inter % world:
        raise ValueError(f"intermediate size {inter} does not split over tensor_parallel_size={world}")
    i0, i1 = inter * rank // world, inter * (rank + 1) // world
    _rows(mlp.gate_proj, i0, i1)
    _rows(mlp.up_proj, i0, i1)
    _cols(mlp.down_proj, i0, i1, rank)
