"""The torch reference ops against independent references (CPU, fast).

- mla_decode (contract C1) vs a plain fp64 per-request / per-query loop over a *contiguous* copy of
  each request's tokens, over a grid of shapes, page sizes, permuted and NaN-poisoned caches.
- mla_prefill (contract C2) vs per-request SDPA with an explicit bottom-right causal mask (fp64).
- apply_rope + rope_cos_sin_cache vs transformers' DeepSeek-V3 / V2 rotary code; softmax_scale vs
  transformers' attention `scaling`.
- write_kv_cache / gather_kv_cache round trips.
- MLAttention: absorbed (mla_decode over the paged latent cache) == naive (MHA over the gathered
  context) == cache-free full-sequence prefill.
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from specmla.config import ModelConfig, RopeConfig
from specmla.engine.kv_pool import KVPool
from specmla.model.deepseek import MLAttention
from specmla.model.metadata import AttentionMetadata
from specmla.model.rope import rope_cos_sin_cache, rope_inv_freq
from specmla.ops.kv_cache import gather_kv_cache, write_kv_cache
from specmla.ops.decode import mla_decode
from specmla.ops.prefill import mla_prefill
from specmla.ops.rope import apply_rope

NAN = float("nan")


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """These tests run thousands of tiny ops: one intra-op thread is several times faster on a busy CPU.
    It also avoids a rare (~1 in 10 processes, 2 threads, loaded machine) first-call deviation of
    ~4e-5 in fp32 lse seen from multi-threaded CPU torch, which the 1e-5 tolerance would flag."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _row_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max over rows of ||out - ref|| / ||ref|| (rows = all leading dims); ref rows must be non-zero."""
    o = out.double().reshape(-1, out.shape[-1])
    r = ref.double().reshape(-1, ref.shape[-1])
    if o.shape[0] == 0:
        return 0.0
    return ((o - r).norm(dim=-1) / r.norm(dim=-1)).max().item()


def _seed(*key) -> int:
    """Deterministic per-case seed (str hashes are randomised per process)."""
    return zlib.crc32(repr(key).encode())


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ref_decode(q: torch.Tensor, tokens: list[torch.Tensor], scale: float, causal: bool, dc: int):
    """Independent C1 reference: fp64, one request and one query at a time, contiguous tokens [L_b, D]."""
    B, S, H, _ = q.shape
    out = torch.zeros(B, S, H, dc, dtype=torch.float64)
    lse = torch.full((B, S, H), -math.inf, dtype=torch.float64)
    for b in range(B):
        kv = tokens[b].double()
        L = kv.shape[0]
        for s in range(S):
            n = L - S + s + 1 if causal else L
            n = max(0, min(n, L))
            if n == 0:
                continue
            scores = q[b, s].double() @ kv[:n].T * scale  # [H, n]
            m = scores.max(dim=-1, keepdim=True).values
            p = torch.exp(scores - m)
            denom = p.sum(dim=-1, keepdim=True)
            out[b, s] = (p / denom) @ kv[:n, :dc]
            lse[b, s] = (m + denom.log()).squeeze(-1)
    return out, lse


def build_paged(tokens: list[torch.Tensor], page_size: int, gen: torch.Generator, dtype, extra_pages: int = 3,
                extra_slots: int = 2, poison_table: str = "nan_pages"):
    """Scatter contiguous per-request tokens into a NaN-filled paged cache with randomly permuted pages.

    Pages that no request references stay NaN, and so does the tail of each request's last page.
    Block-table slots past a request's pages are poisoned (with NaN pages, or out-of-range ids).
    """
    D = tokens[0].shape[-1]
    need = [_ceil_div(t.shape[0], page_size) for t in tokens]
    total = sum(need)
    num_pages = total + extra_pages
    perm = torch.randperm(num_pages, generator=gen).tolist()
    owned, unused = [], perm[total:]
    i = 0
    for n in need:
        owned.append(perm[i : i + n])
        i += n
    cache = torch.full((num_pages, page_size, D), NAN, dtype=dtype)
    width = max(need) + extra_slots
    table = torch.empty(len(tokens), width, dtype=torch.int32)
    for b, (t, pages) in enumerate(zip(tokens, owned)):
        for j in range(t.shape[0]):
            cache[pages[j // page_size], j % page_size] = t[j].to(dtype)
        if poison_table == "nan_pages":
            pad = [unused[k] for k in torch.randint(len(unused), (width - len(pages),), generator=gen).tolist()]
        elif poison_table == "out_of_range":
            pad = [(-1 if k % 2 else num_pages + 1000 + k) for k in range(width - len(pages))]
        else:
            raise ValueError(poison_table)
        table[b] = torch.tensor(pages + pad, dtype=torch.int32)
    return cache, table


def _pick_lens(B: int, S: int, page_size: int, gen: torch.Generator) -> list[int]:
    """Seq lens in 1..300: one == S, one < S*page_size, one not a multiple of page_size, rest random."""
    def r(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    short = r(1, max(1, min(300, S * page_size - 1)))
    off = r(1, 300)
    if page_size > 1 and off % page_size == 0:
        off = off - 1 if off > 1 else off + 1
    cand = [S, short, off] + [r(1, 300) for _ in range(max(0, B - 3))]
    if B < 3:  # rotate which special case(s) small batches get
        k = r(0, 2)
        cand = cand[k:] + cand[:k]
    return cand[:B]


# ---------------------------------------------------------------------------------------------
# mla_decode (C1) vs fp64 loop reference
# ---------------------------------------------------------------------------------------------
DECODE_GRID = list(itertools.product([1, 2, 5], [1, 2, 4], [1, 3, 16], [1, 16, 64], [(512, 64), (32, 16)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("B,S,H,page_size,dims", DECODE_GRID,
                         ids=[f"B{b}-S{s}-H{h}-P{p}-D{d[0]}+{d[1]}" for b, s, h, p, d in DECODE_GRID])
def test_mla_decode_matches_loop_reference(B, S, H, page_size, dims, causal, dtype):
    dc, dr = dims
    D = dc + dr
    seed = _seed(B, S, H, page_size, dims, causal, str(dtype))
    gen = torch.Generator().manual_seed(seed)
    lens = _pick_lens(B, S, page_size, gen)
    tokens = [torch.randn(n, D, generator=gen).to(dtype) for n in lens]
    q = torch.randn(B, S, H, D, generator=gen).to(dtype)
    cache, table = build_paged(tokens, page_size, gen, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = 1.3 * D ** -0.5  # a little sharper than 1/sqrt(D)

    out, lse = mla_decode(q, cache, table, seq_lens, scale, causal=causal, return_lse=True,
                          head_dim_v=dc, backend="torch")
    ref_out, ref_lse = ref_decode(q, tokens, scale, causal, dc)

    assert out.shape == (B, S, H, dc) and out.dtype == dtype
    assert lse.shape == (B, S, H) and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "NaN/inf leaked from poisoned pages"
    empty = torch.isinf(ref_lse)  # rows with no visible key (causal, seq_len < S)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty)
    assert (out[empty] == 0).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _row_rel_err(out[~empty], ref_out[~empty]) <= tol
    lse_tol = 1e-5 if dtype == torch.float32 else 1e-4
    assert (lse[~empty].double() - ref_lse[~empty]).abs().max().item() <= lse_tol if (~empty).any() else True


@pytest.mark.parametrize("causal", [True, False])
def test_mla_decode_fp64_exact_and_out_of_range_table_padding(causal):
    """fp64 in → fp64 accumulation: agrees with the loop to ~1e-12; padding ids -1 / >= num_pages are ignored."""
    gen = torch.Generator().manual_seed(7)
    B, S, H, ps, dc, dr = 4, 3, 5, 8, 32, 16
    lens = [3, 2, 29, 64]
    tokens = [torch.randn(n, dc + dr, generator=gen, dtype=torch.float64) for n in lens]
    q = torch.randn(B, S, H, dc + dr, generator=gen, dtype=torch.float64)
    cache, table = build_paged(tokens, ps, gen, torch.float64, poison_table="out_of_range")
    out, lse = mla_decode(q, cache, table, torch.tensor(lens, dtype=torch.int32), 0.2, causal=causal,
                          return_lse=True, head_dim_v=dc, backend="torch")
    ref_out, ref_lse = ref_decode(q, tokens, 0.2, causal, dc)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert torch.allclose(out, ref_out, rtol=0, atol=1e-12)
    assert torch.allclose(lse[~empty].double(), ref_lse[~empty], rtol=0, atol=1e-6)  # lse is returned as fp32


def test_mla_decode_rows_without_visible_keys():
    """Causal with seq_len < S: the first S - seq_len queries see nothing → out 0, lse -inf; others fine."""
    gen = torch.Generator().manual_seed(11)
    B, S, H, ps, dc, dr = 3, 4, 2, 16, 32, 16
    lens = [1, 3, 4]
    tokens = [torch.randn(n, dc + dr, generator=gen) for n in lens]
    q = torch.randn(B, S, H, dc + dr, generator=gen)
    cache, table = build_paged(tokens, ps, gen, torch.float32)
    out, lse = mla_decode(q, cache, table, torch.tensor(lens, dtype=torch.int32), 0.1, causal=True,
                          return_lse=True, head_dim_v=dc, backend="torch")
    for b, n in enumerate(lens):
        for s in range(S):
            visible = n - S + s + 1
            if visible <= 0:
                assert (out[b, s] == 0).all()
                assert (lse[b, s] == -math.inf).all()
            else:
                assert torch.isfinite(lse[b, s]).all()
                # the last visible key is position visible-1: with one key the output is that key's c_kv
                if visible == 1:
                    torch.testing.assert_close(out[b, s], tokens[b][0, :dc].expand(H, dc), rtol=1e-6, atol=1e-6)
    # seq_len 0 (nothing cached at all), causal or not: every row empty
    for causal in (True, False):
        o, l = mla_decode(q[:1], cache, table[:1], torch.tensor([0], dtype=torch.int32), 0.1, causal=causal,
                          return_lse=True, head_dim_v=dc, backend="torch")
        assert (o == 0).all() and (l == -math.inf).all()


def test_mla_decode_out_param_and_return_lse():
    gen = torch.Generator().manual_seed(3)
    B, S, H, ps, dc, dr = 2, 2, 3, 16, 32, 16
    lens = [5, 40]
    tokens = [torch.randn(n, dc + dr, generator=gen) for n in lens]
    q = torch.randn(B, S, H, dc + dr, generator=gen)
    cache, table = build_paged(tokens, ps, gen, torch.float32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = (q, cache, table, seq_lens, 0.15)
    plain = mla_decode(*args, head_dim_v=dc, backend="torch")
    assert isinstance(plain, torch.Tensor) and plain.shape == (B, S, H, dc)

    out = torch.full((B, S, H, dc), NAN)
    ptr = out.data_ptr()
    res = mla_decode(*args, head_dim_v=dc, backend="torch", out=out)
    assert res is out and out.data_ptr() == ptr
    assert torch.equal(out, plain)

    out2 = torch.full((B, S, H, dc), NAN)
    res2, lse = mla_decode(*args, head_dim_v=dc, backend="torch", out=out2, return_lse=True)
    assert res2 is out2 and torch.equal(out2, plain)
    assert lse.shape == (B, S, H) and lse.dtype == torch.float32
    _, ref_lse = ref_decode(q, tokens, 0.15, True, dc)
    assert (lse.double() - ref_lse).abs().max() <= 1e-5


def test_mla_decode_default_head_dim_v_is_d_minus_64():
    gen = torch.Generator().manual_seed(5)
    tokens = [torch.randn(9, 576, generator=gen)]
    q = torch.randn(1, 1, 2, 576, generator=gen)
    cache, table = build_paged(tokens, 4, gen, torch.float32)
    out = mla_decode(q, cache, table, torch.tensor([9], dtype=torch.int32), 0.05, backend="torch")
    assert out.shape == (1, 1, 2, 512)
    ref, _ = ref_decode(q, tokens, 0.05, True, 512)
    assert _row_rel_err(out, ref) <= 1e-5


def _decode_args(B=2, S=1, H=2, D=48, pages=4, ps=4, width=3):
    return dict(
        q=torch.randn(B, S, H, D), kv_cache=torch.randn(pages, ps, D),
        block_table=torch.zeros(B, width, dtype=torch.int32), seq_lens=torch.full((B,), 3, dtype=torch.int32),
    )


@pytest.mark.parametrize("case", [
    "q_3d", "q_5d", "cache_2d", "cache_width", "table_1d", "table_batch", "seq_lens_batch", "seq_lens_2d",
    "head_dim_v_too_big", "head_dim_v_negative", "default_head_dim_v_too_small_D",
])
def test_mla_decode_bad_shapes_raise_value_error(case):
    a = _decode_args()
    kw = dict(head_dim_v=32)
    if case == "q_3d":
        a["q"] = a["q"][:, 0]
    elif case == "q_5d":
        a["q"] = a["q"][None]
    elif case == "cache_2d":
        a["kv_cache"] = a["kv_cache"].reshape(-1, 48)
    elif case == "cache_width":
        a["kv_cache"] = torch.randn(4, 4, 40)
    elif case == "table_1d":
        a["block_table"] = a["block_table"].reshape(-1)
    elif case == "table_batch":
        a["block_table"] = torch.zeros(3, 3, dtype=torch.int32)
    elif case == "seq_lens_batch":
        a["seq_lens"] = torch.full((3,), 3, dtype=torch.int32)
    elif case == "seq_lens_2d":
        a["seq_lens"] = a["seq_lens"][:, None]
    elif case == "head_dim_v_too_big":
        kw["head_dim_v"] = 49
    elif case == "head_dim_v_negative":
        kw["head_dim_v"] = -1
    elif case == "default_head_dim_v_too_small_D":  # D=48 → default Dc = D - 64 < 0
        kw = {}
    with pytest.raises(ValueError):
        mla_decode(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], 0.1, backend="torch", **kw)


def test_mla_decode_head_dim_v_zero_raises():
    a = _decode_args(D=576)
    with pytest.raises(ValueError):
        mla_decode(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], 0.1, backend="torch", head_dim_v=0)


def test_mla_decode_unknown_backend_raises():
    a = _decode_args()
    with pytest.raises(ValueError):
        mla_decode(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], 0.1, backend="cuda-magic", head_dim_v=32)


# ---------------------------------------------------------------------------------------------
# mla_prefill (C2) vs SDPA per request
# ---------------------------------------------------------------------------------------------
def ref_prefill(q, k, v, lens_q, lens_kv, scale, causal):
    """fp64 SDPA per request with an explicit boolean bottom-right mask; rows without keys → 0 / -inf."""
    H, Dv = q.shape[1], v.shape[-1]
    out = torch.zeros(q.shape[0], H, Dv, dtype=torch.float64)
    lse = torch.full((q.shape[0], H), -math.inf, dtype=torch.float64)
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_kv):
        if lq and lk:
            qi = q[q0 : q0 + lq].double().transpose(0, 1)  # [H, lq, D]
            ki = k[k0 : k0 + lk].double().transpose(0, 1)
            vi = v[k0 : k0 + lk].double().transpose(0, 1)
            if causal:
                t = torch.arange(lq)[:, None]
                j = torch.arange(lk)[None, :]
                mask = j <= t + (lk - lq)  # [lq, lk] bottom-right
            else:
                mask = torch.ones(lq, lk, dtype=torch.bool)
            has = mask.any(dim=-1)  # rows with >= 1 visible key
            o = F.scaled_dot_product_attention(qi[:, has], ki, vi, attn_mask=mask[has], scale=scale)
            out[q0 : q0 + lq][has] = o.transpose(0, 1)
            scores = (qi @ ki.transpose(-1, -2) * scale).masked_fill(~mask, -math.inf)
            lse[q0 : q0 + lq] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
        q0 += lq
        k0 += lk
    return out, lse


PREFILL_BATCHES = {
    "ragged_mixed": [(5, 5), (0, 0), (3, 10), (1, 17), (12, 12), (0, 6), (7, 30)],
    "single_prefix": [(4, 40)],
    "single_full": [(33, 33)],
    "zero_first_last": [(0, 0), (6, 9), (0, 3)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("batch", list(PREFILL_BATCHES), ids=list(PREFILL_BATCHES))
def test_mla_prefill_matches_sdpa(batch, causal, dtype):
    pairs = PREFILL_BATCHES[batch]
    lens_q, lens_kv = [p[0] for p in pairs], [p[1] for p in pairs]
    gen = torch.Generator().manual_seed(_seed(batch, causal))
    H, Dqk, Dv = 3, 24, 16
    q = torch.randn(sum(lens_q), H, Dqk, generator=gen).to(dtype)
    k = torch.randn(sum(lens_kv), H, Dqk, generator=gen).to(dtype)
    v = torch.randn(sum(lens_kv), H, Dv, generator=gen).to(dtype)
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_kv = torch.tensor([0] + lens_kv, dtype=torch.int32).cumsum(0).to(torch.int32)
    scale = 1.2 * Dqk ** -0.5
    out, lse = mla_prefill(q, k, v, cu_q, cu_kv, max(lens_q), max(lens_kv), scale, causal=causal,
                           return_lse=True, backend="torch")
    ref_out, ref_lse = ref_prefill(q, k, v, lens_q, lens_kv, scale, causal)
    assert out.shape == (sum(lens_q), H, Dv) and out.dtype == dtype
    assert lse.shape == (sum(lens_q), H) and lse.dtype == torch.float32
    assert not torch.isinf(ref_lse).any()  # every row here has a visible key
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert _row_rel_err(out, ref_out) <= tol
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-5

    # out= writes in place and return_lse=False returns just the tensor
    buf = torch.full_like(out, NAN)
    res = mla_prefill(q, k, v, cu_q, cu_kv, max(lens_q), max(lens_kv), scale, causal=causal, out=buf, backend="torch")
    assert res is buf and torch.equal(buf, out)


def test_mla_prefill_rows_without_keys():
    """kv_len == 0 with queries, and causal q_len > kv_len: rows that see nothing → 0 and -inf."""
    pairs = [(3, 0), (5, 2), (2, 2)]
    lens_q, lens_kv = [p[0] for p in pairs], [p[1] for p in pairs]
    gen = torch.Generator().manual_seed(2)
    H, D = 2, 8
    q = torch.randn(sum(lens_q), H, D, generator=gen)
    k = torch.randn(sum(lens_kv), H, D, generator=gen)
    v = torch.randn(sum(lens_kv), H, D, generator=gen)
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_kv = torch.tensor([0] + lens_kv).cumsum(0).to(torch.int32)
    out, lse = mla_prefill(q, k, v, cu_q, cu_kv, 5, 2, 0.3, causal=True, return_lse=True, backend="torch")
    ref_out, ref_lse = ref_prefill(q, k, v, lens_q, lens_kv, 0.3, True)
    empty = torch.isinf(ref_lse)
    assert empty[:3].all() and empty[3:6].all() and not empty[6:].any()  # request 1: t + 2 - 5 < 0 for t < 3
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] < 0).all()
    assert (out[empty.all(-1)] == 0).all() and torch.isfinite(out).all()
    assert _row_rel_err(out[~empty.any(-1)], ref_out[~empty.any(-1)]) <= 1e-5


# ---------------------------------------------------------------------------------------------
# rope vs transformers
# ---------------------------------------------------------------------------------------------
ROPE_CASES = {
    "default": None,
    "yarn_mscale_0.707": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                          "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
    "yarn_only_mscale_all_dim": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                 "mscale_all_dim": 0.707},
    "yarn_mscale_1_like_v3": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                              "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    "yarn_only_mscale": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 0.707},
}
SMALL = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16,
             v_head_dim=24, max_position_embeddings=512)


def _hf_config(family: str, rope_scaling, **over):
    from transformers import DeepseekV2Config, DeepseekV3Config

    kw = dict(SMALL, **over)
    if rope_scaling is not None:
        kw["rope_scaling"] = dict(rope_scaling)
    if family == "v2":
        return DeepseekV2Config(**kw)
    return DeepseekV3Config(**kw)


def _ours(family, rope_scaling, **over):
    hf = _hf_config(family, rope_scaling, **over)
    cfg = ModelConfig.from_dict(hf.to_dict())
    return hf, cfg


def _rope_inputs(cfg, rot, seed, T, H, first):
    """Check our frequencies and scale against transformers' rotary module, then random q [T, H, d],
    k [T, d] and positions (edge values `first`, then random below 512)."""
    dim = cfg.qk_rope_head_dim
    torch.testing.assert_close(rope_inv_freq(cfg.rope, dim), rot.inv_freq, rtol=1e-7, atol=0)
    assert cfg.rope.cos_sin_scale == pytest.approx(rot.attention_scaling, rel=1e-12)
    gen = torch.Generator().manual_seed(seed)
    positions = torch.cat([torch.tensor(first), torch.randint(0, 512, (T - len(first),), generator=gen)])
    return positions, torch.randn(T, H, dim, generator=gen), torch.randn(T, dim, generator=gen)


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_v3_interleave_and_neox_match_transformers(case):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    hf, cfg = _ours("v3", ROPE_CASES[case])
    assert cfg.model_type == "deepseek_v3" and cfg.rope.type == ("default" if ROPE_CASES[case] is None else "yarn")
    rot = DeepseekV3RotaryEmbedding(hf)
    dim = cfg.qk_rope_head_dim
    positions, q, k = _rope_inputs(cfg, rot, seed=0, T=37, H=3, first=[0, 1, 127, 128, 511])
    cos_sin = rope_cos_sin_cache(cfg.rope, dim, 512)
    cos, sin = rot(q, positions[None])  # [1, T, dim]

    # transformers wants [B, H, T, D]
    q_hf, k_hf = q.permute(1, 0, 2)[None], k[None, None]
    for interleave, fn in ((True, apply_rotary_pos_emb_interleave), (False, apply_rotary_pos_emb)):
        hq, hk = fn(q_hf, k_hf, cos, sin)
        oq = apply_rope(q, positions, cos_sin, interleave)
        ok = apply_rope(k, positions, cos_sin, interleave)
        torch.testing.assert_close(oq, hq[0].permute(1, 0, 2), rtol=0, atol=1e-6)
        torch.testing.assert_close(ok, hk[0, 0], rtol=0, atol=1e-6)
    assert cfg.rope_interleave is True
    _, cfg_ni = _ours("v3", ROPE_CASES[case], rope_interleave=False)
    assert cfg_ni.rope_interleave is False


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_v2_complex_form_is_our_layout_permuted(case):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding, apply_rotary_emb

    hf, cfg = _ours("v2", ROPE_CASES[case])
    assert cfg.model_type == "deepseek_v2"
    rot = DeepseekV2RotaryEmbedding(hf)
    dim = cfg.qk_rope_head_dim
    positions, q, k = _rope_inputs(cfg, rot, seed=1, T=29, H=4, first=[0, 5, 127, 128, 511])
    freqs_cis = rot(q, positions[None])  # [1, T, dim/2] complex
    hq, hk = apply_rotary_emb(q.permute(1, 0, 2)[None], k[None, None], freqs_cis)
    hq, hk = hq[0].permute(1, 0, 2), hk[0, 0]  # [T, H, dim], [T, dim], interleaved layout

    cos_sin = rope_cos_sin_cache(cfg.rope, dim, 512)
    oq = apply_rope(q, positions, cos_sin, interleave=True)
    ok = apply_rope(k, positions, cos_sin, interleave=True)
    perm = torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])  # [evens, odds]
    torch.testing.assert_close(oq, hq[..., perm], rtol=0, atol=1e-5)
    torch.testing.assert_close(ok, hk[..., perm], rtol=0, atol=1e-5)
    # every q·k score (any query token, any key token) is identical in both layouts
    ours = torch.einsum("thd,sd->hts", oq.double(), ok.double())
    theirs = torch.einsum("thd,sd->hts", hq.double(), hk.double())
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["v2", "v3"])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_softmax_scale_matches_transformers(family, case):
    if family == "v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention as Attn
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention as Attn
    hf, cfg = _ours(family, ROPE_CASES[case])
    assert cfg.softmax_scale == pytest.approx(Attn(hf, 0).scaling, rel=1e-12)
    assert cfg.qk_head_dim == 32 and cfg.latent_dim == 48


def test_rope_apply_shapes_and_dtype():
    """[T, dim] and [T, H, dim] inputs; bf16 in → bf16 out (computed in fp32); position 0 is the identity."""
    rope = RopeConfig()
    cs = rope_cos_sin_cache(rope, 16, 64)
    assert cs.shape == (64, 16) and cs.dtype == torch.float32
    x = torch.randn(5, 3, 16)
    pos = torch.tensor([0, 0, 0, 0, 0])
    for inter in (True, False):
        y = apply_rope(x, pos, cs, inter)
        expect = torch.cat([x[..., 0::2], x[..., 1::2]], -1) if inter else x
        torch.testing.assert_close(y, expect)
    xb = torch.randn(7, 16).bfloat16()
    p = torch.arange(7)
    yb = apply_rope(xb, p, cs)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), apply_rope(xb.float(), p, cs), rtol=1e-2, atol=1e-2)
    # rotation preserves the norm of each pair (cos_sin_scale == 1 for default rope)
    torch.testing.assert_close(apply_rope(x, torch.arange(5) * 7, cs).norm(dim=-1), x.norm(dim=-1))


# ---------------------------------------------------------------------------------------------
# write_kv_cache / gather_kv_cache
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_write_then_gather_round_trip(page_size, dtype):
    gen = torch.Generator().manual_seed(page_size)
    dc, dr = 32, 16
    num_pages = 40
    cache = torch.full((num_pages, page_size, dc + dr), NAN, dtype=dtype)
    # random distinct slots anywhere in the cache
    slots = torch.randperm(num_pages * page_size, generator=gen)[:37]
    c_kv, k_pe = torch.randn(37, dc, generator=gen), torch.randn(37, dr, generator=gen)
    write_kv_cache(cache, c_kv, k_pe, slots.to(torch.int32))
    rows = torch.cat([c_kv, k_pe], -1).to(dtype)
    assert torch.equal(cache.view(-1, dc + dr)[slots.long()], rows)
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool)
    untouched[slots] = False
    assert cache.view(-1, dc + dr)[untouched].isnan().all()

    # per-request pages in arbitrary order, written in two chunks (prefill then decode), gathered back
    cache.fill_(NAN)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    lens = [1, page_size, 3 * page_size + 1, 5]
    tables, data, i = [], [], 0
    for n in lens:
        pages = perm[i : i + _ceil_div(n, page_size)]
        i += len(pages)
        tables.append(torch.tensor(pages + [perm[-1]] * 2, dtype=torch.int32))
        data.append(torch.randn(n, dc + dr, generator=gen))
        slot = torch.tensor([pages[j // page_size] * page_size + j % page_size for j in range(n)])
        cut = n // 2
        for a, b in ((0, cut), (cut, n)):
            write_kv_cache(cache, data[-1][a:b, :dc], data[-1][a:b, dc:], slot[a:b])
    for t, d, n in zip(tables, data, lens):
        got = gather_kv_cache(cache, t, n)
        assert got.shape == (n, dc + dr)
        assert torch.equal(got, d.to(dtype))
        assert gather_kv_cache(cache, t, 0).shape == (0, dc + dr)


def test_write_kv_cache_width_mismatch_raises():
    cache = torch.zeros(4, 4, 48)
    with pytest.raises(ValueError):
        write_kv_cache(cache, torch.randn(2, 32), torch.randn(2, 8), torch.tensor([0, 1]))
    with pytest.raises(ValueError):
        write_kv_cache(cache, torch.randn(2, 40), torch.randn(2, 16), torch.tensor([0, 1]))


# ---------------------------------------------------------------------------------------------
# MLAttention: absorbed decode == naive decode == cache-free full prefill
# ---------------------------------------------------------------------------------------------
def _tiny_cfg(q_lora_rank=None, rope_scaling=None):
    d = dict(SMALL, model_type="deepseek_v3", q_lora_rank=q_lora_rank, n_routed_experts=None,
             n_shared_experts=None, num_experts_per_tok=None)
    if rope_scaling is not None:
        d["rope_scaling"] = dict(rope_scaling, rope_theta=10000.0)
    return ModelConfig.from_dict(d)


def _random_layer(cfg, seed):
    torch.manual_seed(seed)
    layer = MLAttention(cfg)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return layer.eval()


def _churned_pool(cfg, page_size, gen):
    """A KVPool (NaN-filled) whose free list is shuffled by some alloc/free churn."""
    pool = KVPool(1, 64, page_size, cfg.latent_dim, torch.float32, "cpu", fill=NAN)
    ids = list(range(1000, 1064))
    for s in ids:  # one page each: the whole pool
        pool.allocate(s, int(torch.randint(1, page_size + 1, (1,), generator=gen)))
    for j in torch.randperm(len(ids), generator=gen).tolist():
        pool.free(ids[j])
    assert pool.num_free_pages() == 64
    return pool


def _meta(pool, seq_ids, starts, ends, decode_query_len=0, naive_context=False):
    positions, slots, ctx = [], [], []
    for s, a, b in zip(seq_ids, starts, ends):
        positions += range(a, b)
        slots += pool.slots(s, a, b)
        ctx += pool.slots(s, 0, b)
    q_lens = [b - a for a, b in zip(starts, ends)]
    meta = AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.long),
        cu_seqlens_q=torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(ends, dtype=torch.int32),
        max_seqlen_q=max(q_lens),
        max_seqlen_kv=max(ends),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_table=pool.block_table(seq_ids),
        decode_query_len=decode_query_len,
    )
    if naive_context:
        meta.context_slots = torch.tensor(ctx, dtype=torch.long)
        meta.cu_seqlens_kv = torch.tensor([0] + list(ends)).cumsum(0).to(torch.int32)
    return meta


@pytest.mark.parametrize("rope", [None, "yarn"])
@pytest.mark.parametrize("q_lora_rank", [None, 24])
@pytest.mark.parametrize("S", [1, 3])
def test_absorbed_decode_equals_naive_and_full_prefill(S, q_lora_rank, rope):
    cfg = _tiny_cfg(q_lora_rank, ROPE_CASES["yarn_mscale_0.707"] if rope else None)
    layer = _random_layer(cfg, seed=S * 10 + (q_lora_rank or 0))
    gen = torch.Generator().manual_seed(42 + S)
    page_size = 4
    pool = _churned_pool(cfg, page_size, gen)
    cos_sin = rope_cos_sin_cache(cfg.rope, cfg.qk_rope_head_dim, 256)
    seq_ids, prompt_lens = [7, 3, 11], [5, 13, 2]
    total = [n + S for n in prompt_lens]
    x_full = [torch.randn(n, cfg.hidden_size, generator=gen) for n in total]

    with torch.no_grad():
        # prefill the prompts (writes the cache)
        for s, n in zip(seq_ids, prompt_lens):
            pool.allocate(s, n)
        meta_p = _meta(pool, seq_ids, [0] * 3, prompt_lens)
        x_p = torch.cat([x[:n] for x, n in zip(x_full, prompt_lens)])
        y_p = layer(x_p, meta_p, cos_sin, pool.caches[0])

        # decode S tokens per request
        for s, n in zip(seq_ids, total):
            pool.allocate(s, n)
        pages = [p for s in seq_ids for p in pool.pages_of(s)]
        assert len(set(pages)) == len(pages) and pages != sorted(pages)  # distinct, not in order
        x_d = torch.cat([x[n:] for x, n in zip(x_full, prompt_lens)])
        cache_a, cache_n = pool.caches[0].clone(), pool.caches[0].clone()
        meta_a = _meta(pool, seq_ids, prompt_lens, total, decode_query_len=S)
        meta_n = _meta(pool, seq_ids, prompt_lens, total, decode_query_len=S, naive_context=True)
        y_abs = layer(x_d, meta_a, cos_sin, cache_a, force_naive=False)
        y_nai = layer(x_d, meta_n, cos_sin, cache_n, force_naive=True)

        # independent: no cache at all, each whole sequence prefilled at once
        y_full = layer(torch.cat(x_full), AttentionMetadata.for_contiguous(total), cos_sin, None)

    assert torch.isfinite(y_abs).all() and torch.isfinite(y_nai).all()
    assert _row_rel_err(y_abs, y_nai) <= 1e-5
    assert torch.equal(cache_a.nan_to_num(123.0), cache_n.nan_to_num(123.0))
    offs = torch.tensor([0] + total).cumsum(0).tolist()
    full_dec = torch.cat([y_full[o + n : o + t] for o, n, t in zip(offs, prompt_lens, total)])
    full_pre = torch.cat([y_full[o : o + n] for o, n in zip(offs, prompt_lens)])
    assert _row_rel_err(y_abs, full_dec) <= 1e-5
    assert _row_rel_err(y_p, full_pre) <= 1e-5


def test_chunked_prefill_over_cached_prefix_equals_full_prefill():
    """Naive path with context_slots (prefix in the cache, q_len > 8 so not decode) == cache-free prefill."""
    cfg = _tiny_cfg()
    layer = _random_layer(cfg, seed=5)
    gen = torch.Generator().manual_seed(9)
    pool = _churned_pool(cfg, 4, gen)
    cos_sin = rope_cos_sin_cache(cfg.rope, cfg.qk_rope_head_dim, 256)
    seq_ids, first, total = [1, 2], [6, 0 + 3], [21, 15]
    x_full = [torch.randn(n, cfg.hidden_size, generator=gen) for n in total]
    with torch.no_grad():
        for s, n in zip(seq_ids, first):
            pool.allocate(s, n)
        layer(torch.cat([x[:n] for x, n in zip(x_full, first)]), _meta(pool, seq_ids, [0, 0], first), cos_sin,
              pool.caches[0])
        for s, n in zip(seq_ids, total):
            pool.allocate(s, n)
        meta = _meta(pool, seq_ids, first, total, naive_context=True)
        y = layer(torch.cat([x[n:] for x, n in zip(x_full, first)]), meta, cos_sin, pool.caches[0])
        y_full = layer(torch.cat(x_full), AttentionMetadata.for_contiguous(total), cos_sin, None)
    offs = [0, total[0]]
    ref = torch.cat([y_full[o + a : o + t] for o, a, t in zip(offs, first, total)])
    assert _row_rel_err(y, ref) <= 1e-5


def test_public_ops_are_the_contract_callables():
    """`from specmla.ops import mla_decode, mla_prefill, ngram_propose` gives C1–C3's functions, and no package of
    specmla.ops shadows a public function's name."""
    import inspect

    import specmla.ops as ops
    from specmla.ops import mla_decode, mla_prefill, ngram_propose

    for fn, first in ((mla_decode, "q"), (mla_prefill, "q"), (ngram_propose, "tokens")):
        assert inspect.isfunction(fn) and next(iter(inspect.signature(fn).parameters)) == first
    for name in ops.__all__:
        assert not inspect.ismodule(getattr(ops, name)), name
    assert "backend" in inspect.signature(mla_decode).parameters and "opts" in inspect.signature(mla_decode).parameters
