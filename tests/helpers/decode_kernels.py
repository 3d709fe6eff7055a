"""The Hopper decode kernels' GPU tests: `run_kernel` launches one kernel module as `mla_decode` would; decode
problems on quantised caches (random latents written into a cache of a given format, permuted pages, 0xFF bytes past
each request's end) and the per-token check of S > 1 calls."""

from __future__ import annotations

import pytest
import torch

from specmla.ops.decode.hopper import common as G

hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
                                 and G.HAVE_GLUON), reason="needs a Hopper GPU and Gluon")


def quant_case(fmt, seed, B, S, H, T, page):
    """Random latents written into a `fmt` cache of `page`-key pages (permuted), all requests T keys long."""
    from specmla.ops.kv_cache import row_spec, write_kv_cache

    g = torch.Generator().manual_seed(seed)
    pages = B * (-(-T // page))
    c_kv = torch.randn(B * T, 512, generator=g)
    k_pe = torch.randn(B * T, 64, generator=g)
    width, dtype = row_spec(fmt, 512, 64, torch.float32)
    cache = torch.zeros(pages, page, width, dtype=dtype)
    table = torch.randperm(pages, generator=g).view(B, -1).to(torch.int32)
    slots = torch.cat([(table[b].long()[:, None] * page + torch.arange(page)).flatten()[:T] for b in range(B)])
    write_kv_cache(cache, c_kv, k_pe, slots, fmt)
    q = torch.randn(B, S, H, 576, generator=g)
    return q, cache, table


def poison_tails(cache, table, seq):
    """Every cache row past a request's length (in its own pages and in pages nobody owns) becomes
    0xFF bytes: NaN codes, NaN scales and NaN rope, which a kernel must never let into the output."""
    page = cache.shape[1]
    owned = torch.zeros(cache.shape[0] * page, dtype=torch.bool)
    for b, n in enumerate(seq.tolist()):
        slots = (table[b].long()[:, None] * page + torch.arange(page)).flatten()[:n]
        owned[slots] = True
    cache.view(-1, cache.shape[-1])[~owned] = 255


def poisoned_case(fmt, seed, lens, S, H, page, causal, scale=0.0721):
    """(q, cache, table, seq, want, want_lse) on the CPU: `quant_case` with requests of `lens` keys, the rows past each
    end poisoned (`poison_tails`), and the torch reference's output and lse for the call."""
    from specmla.ops.decode import mla_decode

    q, cache, table = quant_case(fmt, seed=seed, B=len(lens), S=S, H=H, T=max(lens), page=page)
    seq = torch.tensor(lens, dtype=torch.int32)
    poison_tails(cache, table, seq)
    want, want_lse = mla_decode(q, cache, table, seq, scale, backend="torch", head_dim_v=512, kv_format=fmt,
                                causal=causal, return_lse=True)
    return q, cache, table, seq, want, want_lse


def quant_problem(lens, S, H=16, seed=0, kv_format="fp8_ds_mla"):
    """(q, cache, block table, lengths) on the GPU: B = len(lens) requests of bf16 queries [B, S, H, 576] over a
    `kv_format` cache of 64-key pages; rows past a request's end hold 0xFF bytes (NaN fp8 codes and scales, NaN
    tbq4 norms and rope), which must not leak."""
    from specmla.ops.kv_cache import row_spec, write_kv_cache

    torch.manual_seed(seed)
    B = len(lens)
    pages = max(-(-n // 64) for n in lens) + 1
    num_pages = B * pages + 3
    latent = torch.randn(num_pages * 64, 576, device="cuda", dtype=torch.bfloat16)
    cache = torch.empty(num_pages, 64, row_spec(kv_format, 512, 64, torch.bfloat16)[0], dtype=torch.uint8,
                        device="cuda")
    write_kv_cache(cache, latent[:, :512], latent[:, 512:], torch.arange(num_pages * 64, device="cuda"), kv_format)
    table = torch.randperm(num_pages, device="cuda", dtype=torch.int32)[: B * pages].view(B, pages)
    for i, n in enumerate(lens):
        cache[int(table[i, (n - 1) // 64]), (n - 1) % 64 + 1:] = 255
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(B, S, H, 576, device="cuda", dtype=torch.bfloat16)
    return q, cache, table, seq


def assert_tokens_match(got, ref, lens, S, max_err, min_cos):
    """S query tokens per request (`quant_problem`'s lengths) against the reference: finite, relative error under
    max_err, every row that sees a key with cosine over min_cos; a token before the request's first key (length < S)
    sees none, and its row is the reference's zeros."""
    got = got.double()
    assert torch.isfinite(got).all()
    assert ((got - ref).norm() / ref.norm()).item() < max_err
    empty = ref.flatten(2).norm(dim=-1) == 0
    assert empty.any() == (min(lens) < S) and (got.flatten(2)[empty].abs() <= 1e-6).all()
    cos = torch.nn.functional.cosine_similarity(got.flatten(2), ref.flatten(2), dim=-1)
    assert cos[~empty].min().item() > min_cos


def run_kernel(module, q, cache, table, seq, scale=576 ** -0.5, *, kv_format, causal=True, num_splits=None,
               opts=None, max_rows=16, return_lse=False, head_dim_v=None, block_n=64):
    """Stage 1 through `module.launch` (a kernel module of `specmla.ops.decode.hopper`) as `mla_decode` runs
    it: the same plan (64-key blocks, one wave), workspace, tbq4 rotations and combine; the test chooses the kernel
    and its options. max_rows: 16 for the e4m3 kernels (S > 1 runs one token per program), up to 32 for dequant,
    64 for the 16-bit kernels; head_dim_v: Dc (default D - 64); block_n: keys per block of the plan."""
    import triton

    from specmla.ops.decode.dispatch import plan
    from specmla.ops.decode.triton import combine_splits
    from specmla.ops.kv_cache.rotation import rotate_rows

    B, S, H, D = q.shape
    dc = D - 64 if head_dim_v is None else head_dim_v
    max_seq = triton.next_power_of_2(table.shape[1]) * cache.shape[1]
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    cfg = plan(B, S, H, max_seq, sms, block_n, max_rows, waves=1)
    assert module.supported(q, cache, kv_format, cfg["BLOCK_M"], head_dim_v=dc), "the kernel does not take this call"
    if num_splits is not None:
        cfg["num_splits"] = num_splits
    ns = cfg["num_splits"]
    out = torch.empty(B, S, H, dc, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, S, H, dtype=torch.float32, device=q.device)
    if ns == 1:
        mid_o, mid_lse = out, lse
    else:
        mid_o = torch.empty(B, S, H, ns, dc, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(B, S, H, ns, dtype=torch.float32, device=q.device)
    if kv_format == "tbq4":  # attention in the rotated domain
        q = rotate_rows(q, dc)
    module.launch(q, cache, table, seq, mid_o, mid_lse, out, lse, scale * 1.4426950408889634, cfg, causal=causal,
                  num_splits=ns, kv_format=kv_format, **({} if opts is None else {"opts": opts}))
    if ns > 1:
        combine_splits(mid_o, mid_lse, out, lse, sms)
    if kv_format == "tbq4":
        rotate_rows(out, dc, out=out)
    return (out, lse) if return_lse else out
