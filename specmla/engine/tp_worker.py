"""Tensor parallelism as identical engines: every rank runs the same LLMEngine on its shard.

Each rank holds its shard of the weights and a full copy of the KV pool, and runs the same scheduler, the same
CUDA graphs and the same sampling. The layers' all-reduces leave every rank with the same hidden states (NCCL's
all-reduce hands each rank the same sums), so every rank samples the same tokens and takes the same scheduling
decisions, step after step. Only the request stream crosses between ranks: rank 0's `TPEngine` forwards each
`add_request` / `abort` to the other ranks, batched with the next `step`, as one JSON message over a `tp_channel`
(shared memory on one host, the gloo group across hosts; a step with nothing new sends an empty message). The
other ranks run `follow_engine`. Nothing is pickled and no rank waits on its GPU for the message.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import torch

from specmla.engine.sequence import Sequence
from specmla.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class TPEngine:
    """Rank 0's engine: the LLMEngine itself, whose request changes reach the other ranks before the next step."""

    def __init__(self, engine, channel):
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_pending", [])
        object.__setattr__(self, "in_step", False)  # a step began and has not returned: the other ranks may be
        # inside a collective
        object.__setattr__(self, "stopped", False)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def __setattr__(self, name, value):
        """Setting an engine attribute here would change rank 0 only and split the ranks apart: refused."""
        if name not in ("_pending", "in_step", "stopped"):
            raise AttributeError(f"cannot set {name!r} on a tensor-parallel engine: every rank must stay identical")
        object.__setattr__(self, name, value)

    def add_request(self, prompt, params: SamplingParams, admit_unfittable: bool = False) -> Sequence:
        seq = self._engine.add_request(prompt, params, admit_unfittable)  # raises before any change on bad input
        # the other ranks get the token ids and the seed this rank drew, so that they sample alike
        self._pending.append(["add", seq.seq_id, seq.prompt_ids,
                              dict(dataclasses.asdict(params), seed=seq.seed), admit_unfittable])
        return seq

    def abort(self, request: Sequence | int) -> bool:
        seq = self._engine._unfinished.get(request) if isinstance(request, int) else request
        done = self._engine.abort(request)
        if done:
            self._pending.append(["abort", seq.seq_id])
        return done

    def step(self) -> list[Sequence]:
        if self.stopped:
            raise RuntimeError("the tensor-parallel ranks are stopped (LLM.shutdown was called)")
        ops, self._pending = self._pending, []
        self.in_step = True
        self._channel.send(json.dumps(ops).encode() if ops else b"")
        out = self._engine.step()
        self.in_step = False
        return out

    def shutdown(self) -> None:
        """Stop the other ranks' `follow_engine` loops."""
        self.stopped = True
        self._channel.send(None)


def follow_engine(engine, channel) -> None:
    """Another rank's loop: apply rank 0's request changes, then step, until rank 0 stops. A step that raises is
    logged and the loop goes on, as rank 0's server does (its aborts of the failed requests arrive next)."""
    seqs: dict[int, Sequence] = {}  # rank 0's request id → this rank's request
    with torch.inference_mode():
        while True:
            msg = channel.recv()
            if msg is None:
                return
            for op in json.loads(msg) if msg else []:
                if op[0] == "add":
                    _, rid, ids, params, admit = op
                    seqs[rid] = engine.add_request(ids, SamplingParams(**params), admit_unfittable=admit)
                elif op[0] == "abort" and op[1] in seqs:
                    engine.abort(seqs[op[1]])
            try:
                engine.step()
            except Exception:
                log.exception("engine step failed on a tensor-parallel rank")
            for rid in [r for r, s in seqs.items() if s.is_finished]:
                del seqs[rid]
