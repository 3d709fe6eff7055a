"""Batched token sampling that stays on the logits' device (vLLM semantics).

Why: the decode step is meant to be captured in a CUDA graph, so sampling must not synchronise
with the host (no .item()/.cpu()/.tolist(), no Python branching on tensor values, no data-dependent
shapes). Every row carries its own temperature / top-k / top-p / seed / step as tensors, and greedy
and sampled rows are computed together and picked with torch.where.

Randomness is counter-based: the uniform for (seed, step, vocab index) is an integer hash of those
three numbers (lowbias32 mixing in int64 tensors), so a request's draws are reproducible and do not
depend on which other requests share the batch or where it sits. A token is drawn with the
exponential race, argmax(probs / E) with E = -log(U) ~ Exp(1), which is exact categorical
sampling (the Gumbel-max trick) and needs no cumsum/searchsorted.

Cost: the noise and the sort are [B, V]; a fused kernel can replace them later with the same
numbers (`uniform_noise` defines the stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-5  # temperatures below this are greedy
_M32 = 0xFFFFFFFF


@dataclass
class SamplingTensors:
    """Per-row sampling parameters, each a [B] tensor on the logits' device."""

    temperature: torch.Tensor  # float32; < GREEDY_EPS means greedy
    top_k: torch.Tensor  # int; <= 0 or >= vocab means disabled
    top_p: torch.Tensor  # float32 in (0, 1]; 1.0 means disabled
    seed: torch.Tensor  # int64 in [0, 2**31)
    step: torch.Tensor  # int64, tokens generated so far (mixed into the random stream)

    @classmethod
    def from_lists(cls, temperature, top_k, top_p, seed, step, device) -> "SamplingTensors":
        """The rows' parameters on `device`; to a GPU in two copies from pinned memory, queued without waiting for
        the device's earlier work."""
        floats = torch.tensor([list(temperature), list(top_p)], dtype=torch.float32)
        ints = torch.tensor([list(top_k), list(seed), list(step)], dtype=torch.int64)
        if torch.device(device).type == "cuda":
            floats, ints = (x.pin_memory().to(device, non_blocking=True) for x in (floats, ints))
        else:
            floats, ints = floats.to(device), ints.to(device)
        return cls(floats[0], ints[0], floats[1], ints[1], ints[2])


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None  # float32 [B], raw log-softmax at the chosen token (None if not asked)
    top_logprobs: torch.Tensor | None  # float32 [B, n], descending
    top_token_ids: torch.Tensor | None  # int64 [B, n]


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), split in 16-bit halves so int64 never overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons): a bijective 32-bit avalanche hash; x holds values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U[b, v] in (0, 1), float32 [B, V], a pure function of (seed[b], step[b], v).

    24 random bits on the grid m * 2**-24 (all exactly representable in float32, < 1); m == 0 is
    moved to 2**-25 so U is never 0.
    """
    seed, step = seed.long()[:, None] & _M32, step.long()[:, None]
    key = _mix32(_mix32(seed ^ 0x243F6A88) ^ ((step >> 32) & _M32))
    key_a = _mix32(key ^ (step & _M32))  # distinct per (seed, step): hashed, not added
    key_b = _mix32(key_a ^ 0x9E3779B9)
    v = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)[None, :]
    h = _mix32(_mix32(v ^ key_a) ^ key_b)
    return (h >> 8).to(torch.float32).clamp_min_(0.5) * 2.0**-24


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits [B, V] to -inf outside each row's top-k, then outside its top-p nucleus.

    Top-k keeps every logit >= the k-th largest, so ties at the boundary may keep a few extra.
    Top-p (on the top-k-renormalised softmax) keeps the smallest descending prefix whose cumulative
    probability reaches p (a token stays iff the mass strictly before it is < p), so the top token
    always stays. Rows with k <= 0 or k >= V, or p >= 1, are untouched.
    """
    vocab = logits.shape[-1]
    k = top_k.long()
    k = torch.where((k <= 0) | (k > vocab), vocab, k).clamp(1, vocab)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    keep = sorted_logits >= kth
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = top_p.float()[:, None]
    first = torch.arange(vocab, device=logits.device) == 0  # the top token stays whatever p is (p = 0 included)
    keep = keep & ((mass_before < p) | (p >= 1.0) | first)
    keep = torch.empty_like(keep).scatter_(1, order, keep)
    return logits.masked_fill(~keep, float("-inf"))


def _check(logits: torch.Tensor, st: SamplingTensors, num_logprobs: int) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D float tensor [B, V], got {tuple(logits.shape)} {logits.dtype}")
    batch, vocab = logits.shape
    for name in ("temperature", "top_k", "top_p", "seed", "step"):
        t = getattr(st, name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (batch,):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"SamplingTensors.{name} must be a [B]={batch} tensor, got {shape}")
        if t.device != logits.device:
            raise ValueError(f"SamplingTensors.{name} is on {t.device}, logits on {logits.device}")
    if not 0 <= num_logprobs <= vocab:
        raise ValueError(f"num_logprobs must be in [0, {vocab}], got {num_logprobs}")


def _logprob_outputs(raw: torch.Tensor, tokens: torch.Tensor, num_logprobs: int) -> SampleOutput:
    logp = raw.log_softmax(dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    if num_logprobs == 0:
        return SampleOutput(tokens, chosen, None, None)
    top_vals, top_ids = logp.topk(num_logprobs, dim=-1)
    return SampleOutput(tokens, chosen, top_vals, top_ids)


def sample(
    logits: torch.Tensor,
    st: SamplingTensors,
    num_logprobs: int = 0,
    *,
    all_greedy: bool = False,
    filtering: bool = True,
    with_logprobs: bool = True,
) -> SampleOutput:
    """Draw one token per row of logits [B, V]; sync-free, so CUDA-graph capturable.

    The keyword flags are facts the caller knows on the host (from the requests' parameters) and
    let whole-batch work be skipped: `all_greedy` (every row greedy: just argmax), `filtering=False`
    (no row uses top-k/top-p: no vocabulary sort), `with_logprobs=False` (no log-softmax; the
    output's `logprobs` is None). Defaults compute everything."""
    _check(logits, st, num_logprobs)
    raw = logits.float()
    if all_greedy:
        tokens = raw.argmax(dim=-1)
    else:
        temp = st.temperature.float()
        greedy = temp < GREEDY_EPS
        scaled = raw / torch.where(greedy, 1.0, temp)[:, None]
        if filtering:
            scaled = apply_top_k_top_p(scaled, st.top_k, st.top_p)
        exp_noise = -torch.log(uniform_noise(st.seed, st.step, raw.shape[1]))
        sampled = (scaled.softmax(dim=-1) / exp_noise).argmax(dim=-1)
        tokens = torch.where(greedy, raw.argmax(dim=-1), sampled)
    if not with_logprobs and num_logprobs == 0:
        return SampleOutput(tokens, None, None, None)
    return _logprob_outputs(raw, tokens, num_logprobs)


def sample_reference(logits: torch.Tensor, st: SamplingTensors, num_logprobs: int = 0) -> SampleOutput:
    """Row-by-row Python version of `sample` (same noise); for tests only, it syncs freely."""
    _check(logits, st, num_logprobs)
    raw = logits.float()
    batch, vocab = raw.shape
    tokens = []
    for r in range(batch):
        temp = float(st.temperature[r])
        if temp < GREEDY_EPS:
            tokens.append(int(raw[r].argmax()))
            continue
        row = raw[r] / temp
        k = int(st.top_k[r])
        if 0 < k < vocab:
            row = row.masked_fill(row < row.sort(descending=True).values[k - 1], float("-inf"))
        p = float(st.top_p[r])
        if p < 1.0:
            vals, idx = row.sort(descending=True)
            probs = vals.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs  # token i stays iff this is < p
            row[idx[mass_before >= p]] = float("-inf")
        u = uniform_noise(st.seed[r : r + 1], st.step[r : r + 1], vocab)[0]
        tokens.append(int((row.softmax(dim=-1) / -torch.log(u)).argmax()))
    return _logprob_outputs(raw, torch.tensor(tokens, dtype=torch.int64, device=raw.device), num_logprobs)
