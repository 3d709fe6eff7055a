"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on CPU).

Layout (per rank r of tp):
- attention: q_proj / q_b_proj and kv_b_proj split by heads (column-parallel), o_proj split by its
  input columns (row-parallel) with an all-reduce; q_a / kv_a replicated — so the latent c_kv is
  the same on every rank and each rank keeps a full copy of the paged latent cache, while its
  decode kernel sees H/tp heads;
- dense MLP: gate/up column-parallel, down row-parallel, all-reduce;
- MoE: expert-parallel — rank r computes the routed experts [r·E/tp, (r+1)·E/tp) (routing is
  replicated, so every rank agrees on it) plus its column/row slice of the shared experts; one
  all-reduce sums the partial outputs;
- embedding and head replicated; MTP modules sharded like the trunk.
Rank 0 runs the engine (scheduler, pool bookkeeping, sampling) and broadcasts every model call to
the workers, which run the same call on their shards, so collectives line up.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn


def tp_group_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_(x: torch.Tensor) -> torch.Tensor:
    if tp_group_size() > 1:
        dist.all_reduce(x)
    return x


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


def shard_model_(model, rank: int, world: int) -> None:
    """Cut a fully loaded model down to rank's shard (in place)."""
    from specmla.model.deepseek import MLP, MLAttention, MoE

    cfg = model.config
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
            E = module.w_down.shape[0]
            if E % world:
                raise ValueError(f"{E} experts do not split over tensor_parallel_size={world}")
            module.local_experts = (E * rank // world, E * (rank + 1) // world)
            module.tp_reduce = True
            if module.shared_experts is not None:
                _split_mlp(module.shared_experts, rank, world)
    for layer in list(model.model.layers) + list(model.mtp):
        if isinstance(layer.mlp, MLP):
            _split_mlp(layer.mlp, rank, world)
            layer.mlp.tp_reduce = True


def _split_mlp(mlp, rank: int, world: int) -> None:
    inter = mlp.gate_proj.out_features
    if inter % world:
        raise ValueError(f"intermediate size {inter} does not split over tensor_parallel_size={world}")
    i0, i1 = inter * rank // world, inter * (rank + 1) // world
    _rows(mlp.gate_proj, i0, i1)
    _rows(mlp.up_proj, i0, i1)
    _cols(mlp.down_proj, i0, i1, rank)
    mlp.tp_role = "split"


class TPModel:
    """Rank 0's stand-in for the model: every forward is broadcast to the workers first."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, meta, kv_caches=None, force_naive=False):
        _broadcast(("forward", (input_ids, meta, None), {"force_naive": force_naive}))  # caches stay local
        return self._model(input_ids, meta, kv_caches, force_naive=force_naive)

    def mtp_forward(self, k, next_ids, prev_hidden, meta, kv_caches=None):
        _broadcast(("mtp_forward", (k, next_ids, prev_hidden, meta), {}))
        return self._model.mtp_forward(k, next_ids, prev_hidden, meta, kv_caches)

    def shutdown(self):
        _broadcast(("stop", (), {}))


def _broadcast(obj) -> None:
    box = [obj]
    dist.broadcast_object_list(box, src=0)


def _to_device(obj, device):
    import dataclasses

    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj)})
    return obj


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def init_group(rank: int, world: int, init_file: str | None, device: str) -> None:
    """Join the tensor-parallel group: env:// under torchrun (multi-node), else a shared file."""
    backend = "gloo" if device == "cpu" else "nccl"
    if device != "cpu":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    init = "env://" if init_file is None else f"file://{init_file}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)


def worker_main(rank: int, world: int, init_file: str | None, model_path: str, llm_kwargs: dict) -> None:
    """A worker rank: load and shard the model, mirror rank 0's KV pool, run every broadcast call.
    init_file None: launched by torchrun (env:// rendezvous)."""
    from specmla.engine.llm import LLM

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    device = llm_kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    init_group(rank, world, init_file, device)
    if device != "cpu":
        llm_kwargs = dict(llm_kwargs, device=f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}")
    llm = LLM(model_path, _tp_rank=rank, _tp_world=world, **llm_kwargs)
    model, caches = llm.model, llm.kv_pool.caches
    here = llm.kv_pool.device
    with torch.inference_mode():
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            op, args, kwargs = box[0]
            if op == "stop":
                break
            args = tuple(_to_device(a, here) for a in args)  # rank 0's tensors arrive on rank 0's device
            if op == "forward":
                args = (args[0], args[1], caches) + tuple(args[3:])
                model(*args, **kwargs)
            elif op == "mtp_forward":
                args = tuple(args[:4]) + (caches,)
                model.mtp_forward(*args, **kwargs)
    dist.destroy_process_group()
