"""Quantised KV cache quality: attention cosine, held-out perplexity and greedy agreement against bf16.

On the embedded model's real activations, CPU or GPU:

1. Attention-output cosine: held-out text runs through the model; at every layer the absorbed
   queries attend over the same latents stored as bf16, fp8 and tbq4 rows (`mla_decode`, torch
   reference on CPU), compared with the unquantised latents.
2. Held-out perplexity with every attention read from the quantised cache: windows are scored
   teacher-forced in decode steps of S tokens (the verify path: each step writes its S rows to
   the paged cache, then attends over the cache with S = 8 query tokens, causal within the step).
3. Greedy agreement: a batch of 32 code prompts generated with each cache format vs bf16.

The "-kernel" formats are the same fp8 / tbq4 caches read with the Hopper e4m3 kernels' arithmetic
(`ops.decode.hopper.e4m3_reference`, a torch emulation of their rounding of q and P): "fp8-kernel" as the fp8
kernel runs (P·V in fp16; the rope's int8 values times their scales rounded to bf16), "fp8_ds_mla-kernel" the same
on FlashMLA's 656-byte rows (bf16 rope), "tbq4-kernel" as the tbq4 kernel runs. The "-tile" formats read them as
`dequant_seesaw` does (`ops.decode.hopper.tile_reference`: keys' latent part dequantised once into fp16 tiles,
P in fp16).
For perplexity and greedy decoding the model's cache reads are routed there by `kernel_reads` (the engine
is unchanged).

    PYTHONPATH=. python3 benchmarks/kv_quant_quality.py --data data/stdlib --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specmla import LLM, SamplingParams
from specmla.engine.kv_pool import KVPool
from specmla.model import deepseek
from specmla.model.default import default_model_path
from specmla.model.metadata import AttentionMetadata
from specmla.ops.kv_cache import row_spec, write_kv_cache
from specmla.ops.kv_cache.rotation import rotate_rows_torch
from specmla.ops.decode import mla_decode
from specmla.ops.decode.hopper.e4m3_reference import mla_decode_e4m3
from specmla.ops.decode.hopper.tile_reference import mla_decode_tiles
from specmla.ops.rope import apply_rope

FORMATS = ("bf16", "fp8", "fp8-kernel", "fp8-tile", "fp8-folded", "fp8_ds_mla", "fp8_ds_mla-kernel", "tbq4",
           "tbq4-kernel", "tbq4-tile", "tbq4-folded")
# format → (its cache format, the emulation of a kernel's arithmetic on the same cache, its settings)
KERNEL_FORMATS = {
    # q in two e4m3 terms, P·V in fp16 (hopper/fp8.py)
    "fp8-kernel": ("fp8", mla_decode_e4m3, dict(q_split=True, p_format="fp16")),
    "fp8_ds_mla-kernel": ("fp8_ds_mla", mla_decode_e4m3, dict(q_split=True, p_format="fp16")),  # on 656-byte rows
    "tbq4-kernel": ("tbq4", mla_decode_e4m3, {}),  # q and P in one e4m3 term each (hopper/tbq4.py)
    "fp8-tile": ("fp8", mla_decode_tiles, {}),  # keys dequantised once into fp16 tiles (hopper/dequant_seesaw.py)
    # q in one e4m3 term against the codes (tbq4: their e4m3 centroids), code · scale in fp16 for P·V
    # (hopper/fp8_folded.py)
    "fp8-folded": ("fp8", mla_decode_tiles, dict(e4m3_scores=True)),
    "tbq4-folded": ("tbq4", mla_decode_tiles, dict(e4m3_scores=True)),
    "tbq4-tile": ("tbq4", mla_decode_tiles, {}),
}


def cache_format(fmt: str) -> str:
    """The kv_format of `fmt`'s cache ("auto" for bf16)."""
    base = KERNEL_FORMATS[fmt][0] if fmt in KERNEL_FORMATS else fmt
    return "auto" if base == "bf16" else base


def attend(fmt: str, q, cache, table, seq_lens, scale, dc):
    """One cache read of `fmt`: the torch reference, or a kernel's emulation for the -kernel and -tile formats."""
    if fmt in KERNEL_FORMATS:
        base, emulation, settings = KERNEL_FORMATS[fmt]
        return emulation(q, cache, table, seq_lens, scale, causal=True, head_dim_v=dc, kv_format=base, **settings)
    return mla_decode(q, cache, table, seq_lens, scale, causal=True, head_dim_v=dc, kv_format=cache_format(fmt))


@contextlib.contextmanager
def kernel_reads(fmt: str):
    """Within: the model's decode / verify reads of the cache (`deepseek.mla_decode`, the absorbed path) go
    through `fmt`'s emulation (`KERNEL_FORMATS`) when fmt is a -kernel, -tile or -folded format; a `rotated` read
    (tbq4 with the rotation folded into the model's weights) has q rotated back before and the output rotated after,
    as `mla_decode` does. Yields a one-element call counter, so that callers can check the reads did go there."""
    calls = [0]
    if fmt not in KERNEL_FORMATS:
        yield calls
        return
    base, emulation, settings = KERNEL_FORMATS[fmt]
    original = deepseek.mla_decode

    def read(q, kv_cache, block_table, seq_lens, softmax_scale, *, causal=True, kv_format="bf16", head_dim_v=None,
             **rest):
        if kv_format != base or rest.get("return_lse") or rest.get("out") is not None:
            return original(q, kv_cache, block_table, seq_lens, softmax_scale, causal=causal, kv_format=kv_format,
                            head_dim_v=head_dim_v, **rest)
        calls[0] += 1
        rotated = rest.pop("rotated", False)
        dc = q.shape[-1] - 64 if head_dim_v is None else head_dim_v
        if rotated:  # the emulations attend in the original domain; the rotation is its own inverse
            q = rotate_rows_torch(q, dc)
        o = emulation(q, kv_cache, block_table, seq_lens, softmax_scale, causal=causal, kv_format=kv_format,
                      head_dim_v=head_dim_v, **settings)
        return rotate_rows_torch(o, dc) if rotated else o

    deepseek.mla_decode = read
    try:
        yield calls
    finally:
        deepseek.mla_decode = original


def capture_attention_inputs(model, ids: torch.Tensor):
    """(absorbed q [T, H, Dc+Dr], latent [T, Dc+Dr]) of every layer for one causal sequence."""
    grabbed = []
    hooks = []
    for layer in model.model.layers:
        attn = layer.self_attn

        def hook(mod, args, out, attn=attn):
            x, meta = args[0], args[1]
            cfg, H = attn.cfg, attn.num_heads
            q = (attn.q_proj(x) if cfg.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))))
            q = q.view(x.shape[0], H, cfg.qk_head_dim)
            q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
            c_kv, k_pe = attn.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
            c_kv = attn.kv_a_layernorm(c_kv)
            q_pe = apply_rope(q_pe, meta.positions, model.cos_sin, cfg.rope_interleave)
            k_pe = apply_rope(k_pe, meta.positions, model.cos_sin, cfg.rope_interleave)
            w_uk, _ = attn.absorbed_weights()
            q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
            grabbed.append((torch.cat([q_lat, q_pe], -1), torch.cat([c_kv, k_pe], -1), cfg.softmax_scale))

        hooks.append(attn.register_forward_hook(hook))
    with torch.no_grad():
        model(ids, AttentionMetadata.for_contiguous([ids.shape[0]]))
    for h in hooks:
        h.remove()
    return grabbed


def attention_cosines(model, ids: torch.Tensor, formats=FORMATS, page: int = 16) -> dict:
    out = {f: [] for f in formats}
    T = ids.shape[0]
    pages = -(-T // page)
    table = torch.randperm(pages, dtype=torch.int32)[None]  # pages in any order
    for q, latent, scale in capture_attention_inputs(model, ids):
        dc = latent.shape[-1] - 64
        q_last = q[-32:][None].float()  # the last 32 positions attend over the whole window
        seq_q = torch.tensor([T], dtype=torch.int32)
        exact = None
        for fmt in ("exact",) + tuple(formats):
            kv_fmt = "auto" if fmt == "exact" else cache_format(fmt)
            dtype = torch.float32 if fmt == "exact" else torch.bfloat16
            width, row_dtype = row_spec(kv_fmt, dc, 64, dtype)
            cache = torch.zeros(pages, page, width, dtype=row_dtype)
            slots = (table[0].long()[torch.arange(T) // page] * page + torch.arange(T) % page)
            write_kv_cache(cache, latent[:, :dc].to(dtype), latent[:, dc:].to(dtype), slots, kv_fmt)
            if fmt == "exact":
                o = mla_decode(q_last, cache, table, seq_q, scale, causal=True, head_dim_v=dc, kv_format=kv_fmt)
            else:
                o = attend(fmt, q_last.to(torch.bfloat16).float(), cache, table, seq_q, scale, dc)
            o = o.float()
            if fmt == "exact":
                exact = o
                continue
            cos = F.cosine_similarity(o.reshape(-1, dc), exact.reshape(-1, dc), dim=-1)
            out[fmt].append(cos)
    return {f: {"min": torch.cat(v).min().item(), "mean": torch.cat(v).mean().item()} for f, v in out.items()}


@torch.no_grad()
def teacher_forced_nll(model, tokens: np.ndarray, fmt: str, S: int = 8, page: int = 16) -> tuple[float, int]:
    """Σ NLL of tokens[1:] with every attention read from a `fmt` cache (decode steps of S tokens); -kernel
    formats read it through `kernel_reads` (the caller's context)."""
    cfg = model.config
    L = len(tokens) - 1
    L -= L % S
    kv_fmt = cache_format(fmt)
    pool = KVPool(model.num_cache_layers, -(-L // page), page, cfg.latent_dim, torch.bfloat16 if fmt == "bf16"
                  else torch.float32, "cpu", kv_format=kv_fmt, kv_lora_rank=cfg.kv_lora_rank)
    table = torch.arange(pool.num_pages, dtype=torch.int32)[None]
    ids = torch.from_numpy(tokens.astype(np.int64))
    nll = 0.0
    for t0 in range(0, L, S):
        pos = torch.arange(t0, t0 + S)
        meta = AttentionMetadata(
            positions=pos, cu_seqlens_q=torch.tensor([0, S], dtype=torch.int32),
            seq_lens=torch.tensor([t0 + S], dtype=torch.int32), max_seqlen_q=S, max_seqlen_kv=t0 + S,
            slot_mapping=pos, block_table=table, decode_query_len=S, kv_format=kv_fmt)
        logits = model.compute_logits(model(ids[t0 : t0 + S], meta, pool.caches)).float()
        nll += F.cross_entropy(logits, ids[t0 + 1 : t0 + S + 1], reduction="sum").item()
    return nll, L


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompts", default="data/bench/code_complete.jsonl")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, from " + ", ".join(FORMATS))
    args = ap.parse_args()
    formats = tuple(args.formats.split(","))
    if formats[0] != "bf16" or not set(formats) <= set(FORMATS):
        ap.error(f"--formats: bf16 first, then any of {FORMATS}")
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    torch.manual_seed(0)
    path = default_model_path()
    heldout = np.fromfile(Path(args.data) / "heldout.bin", dtype=np.uint16)
    llm = LLM(path, device="cpu", dtype="float32")
    model = llm.model
    report = {"model": str(path)}
    cos = [attention_cosines(model, torch.from_numpy(heldout[i * 700 : i * 700 + 600].astype(np.int64)), formats)
           for i in range(2)]
    report["attention_cosine"] = {f: {"min": min(c[f]["min"] for c in cos), "mean": sum(c[f]["mean"] for c in cos) / 2}
                                  for f in formats}
    print("attention-output cosine vs unquantised (real activations):", json.dumps(report["attention_cosine"]),
          f"[{time.time() - t_start:.0f} s]", flush=True)
    ppl, reads = {}, {}
    for fmt in formats:
        tot, n = 0.0, 0
        with kernel_reads(fmt) as calls:
            for w in range(args.windows):
                a, b = teacher_forced_nll(model, heldout[w * (args.window + 1) : (w + 1) * (args.window + 1)], fmt)
                tot, n = tot + a, n + b
                print(f"  {fmt} window {w + 1}/{args.windows}: running ppl {math.exp(tot / n):.4f} "
                      f"[{time.time() - t_start:.0f} s]", flush=True)
        if fmt in KERNEL_FORMATS:
            assert calls[0] > 0, f"{fmt}: no cache read went through its emulation"
            reads[fmt] = calls[0]
        ppl[fmt] = math.exp(tot / n)
        print(f"held-out perplexity, {fmt} cache: {ppl[fmt]:.4f} ({n} tokens)", flush=True)
    report["heldout_ppl"] = ppl
    report["ppl_delta_pct"] = {f: 100 * (ppl[f] / ppl["bf16"] - 1) for f in formats}
    report["ppl_kernel_reads"] = reads  # emulated reads per -kernel / -tile format (all layers, all steps)
    prompts = [json.loads(ln)["prompt"] for ln in Path(args.prompts).read_text().splitlines()[:32]]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outs, reads = {}, {}
    for fmt in formats:
        with kernel_reads(fmt) as calls:  # fp32 weights, only the cache (and its reads) differ
            g = LLM(path, device="cpu", dtype="float32", kv_cache_dtype=cache_format(fmt).replace("auto", "bf16"))
            outs[fmt] = [o.token_ids for o in g.generate(prompts, params)]
        if fmt in KERNEL_FORMATS:
            assert calls[0] > 0, f"{fmt}: no cache read went through its emulation"
            reads[fmt] = calls[0]
        print(f"greedy, {fmt} cache: done [{time.time() - t_start:.0f} s]", flush=True)
    report["greedy_identical_prompts_vs_bf16"] = {f: sum(a == b for a, b in zip(outs[f], outs["bf16"])) / len(prompts)
                                                  for f in formats}
    report["greedy_token_agreement_vs_bf16"] = {
        f: sum(x == y for a, b in zip(outs[f], outs["bf16"]) for x, y in zip(a, b)) / (32 * len(prompts))
        for f in formats}
    report["greedy_kernel_reads"] = reads
    print(json.dumps(report, indent=1))
    with open(os.path.join(args.out, "kv_quant_quality.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
