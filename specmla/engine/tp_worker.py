"""Rank 0's model calls, replayed on every tensor-parallel rank.

Rank 0 runs the engine (scheduler, pool bookkeeping, sampling); its model is wrapped in `TPModel`,
which broadcasts every `forward` / `mtp_forward` to the workers before running it on its own shard.
Each worker runs `serve_model_calls`: it receives the same calls in the same order and runs them on
its shard with its own KV caches, so the layers' all-reduces line up across ranks.
"""

from __future__ import annotations

import dataclasses

import torch

from specmla.distributed import broadcast_object


class TPModel:
    """Rank 0's stand-in for the model: every forward is broadcast to the workers first."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, meta, kv_caches=None, force_naive=False):
        broadcast_object(("forward", (input_ids, meta, None), {"force_naive": force_naive}))  # caches stay local
        return self._model(input_ids, meta, kv_caches, force_naive=force_naive)

    def mtp_forward(self, k, next_ids, prev_hidden, meta, kv_caches=None):
        broadcast_object(("mtp_forward", (k, next_ids, prev_hidden, meta), {}))
        return self._model.mtp_forward(k, next_ids, prev_hidden, meta, kv_caches)

    def shutdown(self):
        broadcast_object(("stop", (), {}))


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj)})
    return obj


def serve_model_calls(model, caches: list[torch.Tensor], device: torch.device) -> None:
    """A worker's loop: run every call rank 0's `TPModel` broadcasts, on this rank's shard and
    caches, until rank 0 sends "stop"."""
    with torch.inference_mode():
        while True:
            op, args, kwargs = broadcast_object()
            if op == "stop":
                break
            args = tuple(_to_device(a, device) for a in args)  # rank 0's tensors arrive on rank 0's device
            if op == "forward":
                args = (args[0], args[1], caches) + tuple(args[3:])
                model(*args, **kwargs)
            elif op == "mtp_forward":
                args = tuple(args[:4]) + (caches,)
                model.mtp_forward(*args, **kwargs)
