"""Tensor parallelism as identical engines: every rank runs the same LLMEngine on its shard.

Each rank holds its shard of the weights and a full copy of the KV pool, and runs the same scheduler, the same
CUDA graphs and the same sampling. The layers' all-reduces leave every rank with the same hidden states (NCCL's
all-reduce hands each rank the same sums), so every rank samples the same tokens and takes the same scheduling
decisions, step after step. Only the request stream crosses between ranks: rank 0's `TPEngine` forwards each
`add_request` / `abort` to the other ranks, batched with the next `step`, as one message over a `tp_channel`
(shared memory on one host, the gloo group across hosts): an 8-byte digest of rank 0's requests after its last step
(`state_digest`), then the JSON ops, if any. The other ranks run `follow_engine`, which compares the digest with
its own before it steps: ranks that drifted apart (a step that failed on one rank only, say) stop with an error
instead of computing with mismatched batches. Nothing is pickled and no rank waits on its GPU for the message.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import zlib

import torch

from specmla.engine.sequence import Sequence
from specmla.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_DIGEST = struct.Struct("<Q")
_REQ = struct.Struct("<qqq")


def state_digest(engine) -> int:
    """CRC-32 of each unfinished request's (computed tokens, output tokens, last output token), in the scheduler's
    waiting then running order: equal on two ranks whose engines took the same steps."""
    crc = 0
    for s in list(engine.waiting) + list(engine.running):
        crc = zlib.crc32(_REQ.pack(s.num_cached, len(s.output_ids), s.output_ids[-1] if s.output_ids else -1), crc)
    return crc


class TPEngine:
    """Rank 0's engine: the LLMEngine itself, whose request changes reach the other ranks before the next step."""

    def __init__(self, engine, channel):
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_pending", [])
        object.__setattr__(self, "in_step", False)  # a step began and has not returned: the other ranks may be
        # inside a collective
        object.__setattr__(self, "stopped", False)
        object.__setattr__(self, "_digest", 0)  # state_digest after the last step (0 before the first)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def __setattr__(self, name, value):
        """Setting an engine attribute here would change rank 0 only and split the ranks apart: refused."""
        if name not in ("_pending", "in_step", "stopped", "_digest"):
            raise AttributeError(f"cannot set {name!r} on a tensor-parallel engine: every rank must stay identical")
        object.__setattr__(self, name, value)

    def add_request(self, prompt, params: SamplingParams, admit_unfittable: bool = False) -> Sequence:
        seq = self._engine.add_request(prompt, params, admit_unfittable)  # raises before any change on bad input
        # the other ranks get the token ids and the seed this rank drew, so that they sample alike
        self._pending.append(["add", seq.seq_id, seq.prompt_ids,
                              dict(dataclasses.asdict(params), seed=seq.seed), admit_unfittable])
        return seq

    def abort(self, request: Sequence | int) -> bool:
        done = self._engine.abort(request)
        if done:  # a request id is its seq_id
            self._pending.append(["abort", request if isinstance(request, int) else request.seq_id])
        return done

    def step(self) -> list[Sequence]:
        if self.stopped:
            raise RuntimeError("the tensor-parallel ranks are stopped (LLM.shutdown was called)")
        ops, self._pending = self._pending, []
        self.in_step = True
        self._channel.send(_DIGEST.pack(self._digest) + (json.dumps(ops).encode() if ops else b""))
        try:
            out = self._engine.step()
        except BaseException:  # in_step stays set: the other ranks may be waiting inside a collective
            self._digest = state_digest(self._engine)
            raise
        self.in_step = False
        self._digest = state_digest(self._engine)
        return out

    def shutdown(self) -> None:
        """Stop the other ranks' `follow_engine` loops."""
        self.stopped = True
        self._channel.send(None)


def follow_engine(engine, channel) -> None:
    """Another rank's loop: check that this rank's requests match rank 0's digest, apply rank 0's request changes,
    then step, until rank 0 stops. A step that raises is logged and the loop goes on, as rank 0's server does (its
    aborts of the failed requests arrive next); if it raised on this rank only, the next digest differs and the loop
    raises RuntimeError (the process exits, and rank 0, which watches it, stops every rank)."""
    seqs: dict[int, Sequence] = {}  # rank 0's request id → this rank's request
    digest = 0
    with torch.inference_mode():
        while True:
            msg = channel.recv()
            if msg is None:
                return
            (want,) = _DIGEST.unpack_from(msg)
            if want != digest:
                raise RuntimeError(f"this tensor-parallel rank's requests no longer match rank 0's (digest {digest:#x}, "
                                   f"rank 0 {want:#x}): the ranks took different steps")
            body = msg[_DIGEST.size :]
            for op in json.loads(body) if body else []:
                if op[0] == "add":
                    _, rid, ids, params, admit = op
                    seqs[rid] = engine.add_request(ids, SamplingParams(**params), admit_unfittable=admit)
                elif op[0] == "abort" and op[1] in seqs:
                    engine.abort(seqs[op[1]])
            try:
                engine.step()
            except Exception:
                log.exception("engine step failed on a tensor-parallel rank")
            digest = state_digest(engine)
            for rid in [r for r, s in seqs.items() if s.is_finished]:
                del seqs[rid]
