"""Speculative decoding: draft proposers and the lossless verification of their drafts.

A verify step runs the target model on 1 + k tokens per request (the last accepted token and k
drafts; requests with fewer drafts are padded, and padded positions are never accepted) through the
decode path with S = 1 + k, so one pass over the KV pages scores every draft.

- Greedy rows accept the longest prefix of drafts equal to the target's argmax, then emit the
  target's argmax at the first mismatch (or after the last draft: the bonus token).
- Sampled rows use rejection sampling (Leviathan et al. 2023). Drafts are proposed greedily, so
  the draft distribution q is one-hot: draft d at position j is accepted with probability p_j(d);
  at the first rejection the token is drawn from the residual (p_j − q_j)+ ∝ p_j with d removed;
  if every draft is accepted the bonus token is drawn from p_k. The emitted tokens then follow the
  target distribution exactly.
All of it is batched tensor code without host synchronisation; the randomness comes from the same
counter-based generator as plain sampling, keyed by (request seed, output position).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specmla.engine.ngram_index import NgramIndex
from specmla.ops.spec_accept import greedy_verify
from specmla.ops.sampling import GREEDY_EPS, SamplingTensors, apply_top_k_top_p, uniform_noise

ACCEPT_STREAM = 0x5BD1E995  # seeds the accept/reject draws apart from the token draws


def target_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[B, S, V] fp32 distributions after each row's temperature / top-k / top-p."""
    B, S, V = logits.shape
    temp = st.temperature.float().clamp_min(GREEDY_EPS)
    flat = (logits.float() / temp[:, None, None]).reshape(B * S, V)
    rep = lambda t: t.repeat_interleave(S)  # noqa: E731
    return apply_top_k_top_p(flat, rep(st.top_k), rep(st.top_p)).softmax(-1).view(B, S, V)


def verify(drafts: torch.Tensor, num_drafts: torch.Tensor, logits: torch.Tensor, st: SamplingTensors | None,
           all_greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts int64 [B, k], num_drafts int [B], target logits [B, k+1, V] (position j scores the
    token after the j-th input) → (tokens int64 [B, k+1], emitted int32 [B]): request b emits
    tokens[b, :emitted[b]] = its accepted drafts followed by one target token. `st` is unused (may be
    None) when all_greedy."""
    B, S, V = logits.shape
    k = S - 1
    valid = torch.arange(k, device=logits.device)[None, :] < num_drafts.long()[:, None]
    greedy_out, accepted = greedy_verify(drafts, num_drafts, logits.argmax(-1))
    if all_greedy:
        return greedy_out, (accepted + 1).to(torch.int32)

    probs = target_probs(logits, st)  # [B, S, V]
    steps = st.step.long()[:, None] + torch.arange(S, device=logits.device)[None, :]  # output index per position
    seeds = st.seed.long()[:, None].expand(B, S)
    u = uniform_noise((seeds ^ ACCEPT_STREAM).reshape(-1), steps.reshape(-1), 1).view(B, S)[:, :k]
    p_draft = probs[:, :k].gather(2, drafts[:, :, None]).squeeze(2)
    ok = (u < p_draft) & valid
    s_accepted = ok.long().cumprod(1).sum(1)
    # at a rejected draft position the residual drops the draft; elsewhere (bonus) it is p itself
    residual = probs.clone()
    drop = torch.zeros_like(residual[:, :k]).scatter_(2, drafts[:, :, None], 1.0).bool() & valid[:, :, None]
    residual[:, :k] = residual[:, :k].masked_fill(drop, 0.0)
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, probs, residual)
    noise = -torch.log(uniform_noise(seeds.reshape(-1), steps.reshape(-1), V)).view(B, S, V)
    race = (residual / noise).argmax(-1)  # [B, S]: a draw from each position's residual
    sampled_out = torch.where(torch.arange(S, device=logits.device)[None, :] < s_accepted[:, None],
                              torch.cat([drafts, race[:, -1:]], 1), race)
    greedy = (st.temperature < GREEDY_EPS)[:, None]
    tokens = torch.where(greedy, greedy_out, sampled_out)
    emitted = torch.where(greedy[:, 0], accepted, s_accepted) + 1
    return tokens, emitted.to(torch.int32)


def greedy_accept(drafts: list[list[int]], num_drafts: list[int], argmax: list[list[int]]
                  ) -> tuple[list[list[int]], list[int]]:
    """`verify`'s all-greedy case on host lists: (tokens, emitted) per request, tokens = the longest
    prefix of drafts equal to the target's argmax followed by the argmax after it. For all-greedy
    batches the engine takes this path: one small [B, S] argmax copy instead of a verify pass."""
    tokens, emitted = [], []
    for d, n, am in zip(drafts, num_drafts, argmax):
        a = 0
        while a < n and d[a] == am[a]:
            a += 1
        tokens.append(d[:a] + [am[a]])
        emitted.append(a + 1)
    return tokens, emitted


@dataclass
class SpecStats:
    """Counters in vLLM's terms: drafts (verify steps with ≥ 1 draft), draft tokens, accepted tokens,
    accepted per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, n_draft: int, n_accepted: int) -> None:
        if n_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += n_draft
        self.num_accepted_tokens += n_accepted
        if len(self.accepted_per_position) < n_draft:
            self.accepted_per_position += [0] * (n_draft - len(self.accepted_per_position))
        for i in range(n_accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step that had drafts (accepted + the target's own token)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "mean_acceptance_length": self.mean_acceptance_length}


class NgramProposer:
    """Drafts from the request's own prompt and output: `ops.ngram_propose`'s drafts, from an n-gram index each
    request keeps on the host (`NgramIndex`), grown by the tokens appended since its last step."""

    uses_mtp = False
    whole_step_graph = False  # its drafts come from host-side token lists

    def __init__(self, num_speculative_tokens: int, ngram_min: int = 1, ngram_max: int = 3):
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.k, self.ngram_min, self.ngram_max = num_speculative_tokens, ngram_min, ngram_max
        self._index: dict[int, NgramIndex] = {}  # seq_id → its index, until it finishes

    def draft(self, seq, cap: int) -> list[int]:
        """Up to min(cap, k) drafts for the request after its tokens so far."""
        idx = self._index.get(seq.seq_id)
        if idx is None:
            idx = self._index[seq.seq_id] = NgramIndex(self.ngram_min, self.ngram_max)
        idx.sync(seq.all_ids)
        return idx.draft(min(cap, self.k))

    def propose_for(self, seqs, caps: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        return _as_tensors([self.draft(s, cap) for s, cap in zip(seqs, caps)], self.k, device)

    def observe(self, seq, emitted: list[int]) -> None:
        """The tokens a step emitted for the request (the proposers that learn from them override this)."""

    def forget(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)


def _as_tensors(drafts: list[list[int]], k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts per request → (int64 [B, k] zero-padded, int32 [B] counts) on `device`."""
    out = torch.zeros(len(drafts), k, dtype=torch.long)
    for i, d in enumerate(drafts):
        if d:
            out[i, : len(d)] = torch.tensor(d, dtype=torch.long)
    return out.to(device), torch.tensor([len(d) for d in drafts], dtype=torch.int32, device=device)


class MtpProposer:
    """Drafts from the model's own MTP module(s): the runner runs the module after every forward
    (`ModelRunner.mtp_catch_up_and_draft`), and the drafts wait on the request for its next step."""

    uses_mtp = True
    whole_step_graph = True  # greedy steps may run as one graph (ModelRunner.launch_greedy_mtp_step)

    def __init__(self, num_speculative_tokens: int):
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.k = num_speculative_tokens

    @property
    def num_mtp_drafts(self) -> int:
        """Tokens the MTP module drafts per step (all k here)."""
        return self.k

    def prefers_mtp(self, seq) -> bool:
        """Whether the request's drafts this step are its MTP drafts (always here)."""
        return True

    def candidates(self, seqs, caps: list[int]) -> list[list[int]]:
        """Each request's drafts this step, at most min(cap, k)."""
        return [s.drafts[: min(cap, self.k)] for s, cap in zip(seqs, caps)]

    def propose_for(self, seqs, caps: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        return _as_tensors(self.candidates(seqs, caps), self.k, device)

    def observe(self, seq, emitted: list[int]) -> None:
        """The tokens a step emitted for the request (the proposers that learn from them override this)."""

    def forget(self, seq_id: int) -> None:
        pass


class HybridProposer(MtpProposer):
    """Per request and step, the drafts of the source that has been getting more of them accepted: the MTP module's
    k drafts or the n-gram match over the request's tokens, so hybrid does at least as well as the better of the
    two on each request. Both sources are scored after every step: the one used by its accepted drafts, the other by
    how many of its drafts equal the tokens the step emitted (checked as far as those reach). A batch whose every
    request takes the MTP drafts runs as the MTP proposer's (the one-replay step where greedy)."""

    def __init__(self, num_speculative_tokens: int, ngram_min: int = 1, ngram_max: int = 3, decay: float = 0.8):
        super().__init__(num_speculative_tokens)
        self.ngram = NgramProposer(num_speculative_tokens, ngram_min, ngram_max)
        self.decay = decay
        self._gain: dict[int, list[float]] = {}  # seq_id → running accepted drafts a step: [MTP, n-gram]
        self._pending: dict[int, tuple[list[int], list[int]]] = {}  # seq_id → this step's candidates

    def prefers_mtp(self, seq) -> bool:
        g = self._gain.get(seq.seq_id)
        return g is None or g[0] >= g[1]

    def candidates(self, seqs, caps: list[int]) -> list[list[int]]:
        """Record both sources' drafts for this step and return the preferred one's per request."""
        out = []
        for s, cap in zip(seqs, caps):
            pair = (s.drafts[: min(cap, self.k)], self.ngram.draft(s, cap))
            self._pending[s.seq_id] = pair
            out.append(pair[0] if self.prefers_mtp(s) else pair[1])
        return out

    def observe(self, seq, emitted: list[int]) -> None:
        """The step's emitted tokens for the request: score both of its candidates."""
        pair = self._pending.pop(seq.seq_id, None)
        if pair is None:
            return
        g = self._gain.setdefault(seq.seq_id, [0.0, 0.0])
        for src, d in enumerate(pair):
            m = 0
            while m < len(d) and m < len(emitted) and d[m] == emitted[m]:
                m += 1
            g[src] = g[src] * self.decay + m * (1 - self.decay)

    def forget(self, seq_id: int) -> None:
        self._gain.pop(seq_id, None)
        self._pending.pop(seq_id, None)
        self.ngram.forget(seq_id)
