"""Quantised latent caches (fp8, fp8_ds_mla, tbq4): layouts, round trips, attention quality, engine runs."""

import math

import pytest
import torch
import triton
import triton.language as tl
from helpers.mla_cases import rel_err

from specmla import LLM, SamplingParams
from specmla.ops.kv_cache import tbq4
from specmla.ops.kv_cache import (decode_rows, encode_rows, rope_int8, rope_offset, rope_scales_offset, row_spec,
                                  write_kv_cache)
from specmla.ops.kv_cache.triton import _bf16_rne, _e4m3_rne, _tf32_part
from specmla.ops.decode import mla_decode


def test_row_layouts():
    assert row_spec("fp8_ds_mla", 512, 64, torch.bfloat16) == (656, torch.uint8)  # FlashMLA's 656-byte row
    # the same codes and scales, then 8 fp16 rope scales and 64 int8 rope values
    assert row_spec("fp8", 512, 64, torch.bfloat16) == (512 + 16 + 16 + 64, torch.uint8)
    assert rope_scales_offset(512) == 528 and rope_offset("fp8", 512, 64) == 544
    assert row_spec("fp8", 128, 16, torch.bfloat16) == (128 + 4 + 4 + 16, torch.uint8)
    # tbq4: codes and norms (66 bytes per 128 values) padded to 16 bytes, then the bf16 rope, padded to 16
    assert row_spec("tbq4", 512, 64, torch.bfloat16) == (272 + 128, torch.uint8)  # 264 → 272, 400 bytes
    assert row_spec("auto", 512, 64, torch.bfloat16) == (576, torch.bfloat16)
    assert row_spec("tbq4", 128, 64, torch.bfloat16) == (80 + 128, torch.uint8)  # 66 → 80
    assert row_spec("tbq4", 256, 16, torch.bfloat16) == (144 + 32, torch.uint8)  # 132 → 144
    assert row_spec("tbq4", 512, 8, torch.bfloat16) == (272 + 16, torch.uint8)
    for dc, dr in [(128, 64), (256, 16), (512, 64), (384, 32)]:
        assert tbq4.rope_offset(dc) % 16 == 0 and row_spec("tbq4", dc, dr, torch.bfloat16)[0] % 16 == 0
    with pytest.raises(ValueError):
        row_spec("fp8_ds_mla", 100, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="Dr divisible by 8"):
        row_spec("fp8", 512, 60, torch.bfloat16)
    with pytest.raises(ValueError):
        row_spec("int3", 512, 64, torch.bfloat16)


def test_lloyd_max_centroids_are_the_gaussian_optimum():
    c = torch.tensor(tbq4.lloyd_max_centroids(), dtype=torch.float64) * math.sqrt(tbq4.BLOCK)
    assert torch.allclose(c, -c.flip(0))  # symmetric
    # the known 16-level Lloyd–Max quantiser of N(0, 1): outermost ±2.7326, innermost ±0.1284
    assert abs(c[-1].item() - 2.7326) < 1e-3 and abs(c[8].item() - 0.1284) < 1e-3
    z = torch.randn(400_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mse = ((z[:, None] - c).abs().min(-1).values ** 2).mean().item()
    assert abs(mse - 0.009497) < 4e-4  # its distortion


def test_fwht_is_orthonormal_and_self_inverse():
    x = torch.randn(5, 128)
    y = tbq4.fwht(x)
    assert torch.allclose(tbq4.fwht(y), x, atol=1e-5)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    with pytest.raises(ValueError):
        tbq4.fwht(torch.randn(3, 96))


@pytest.mark.parametrize("fmt,tol", [("fp8_ds_mla", 0.04), ("fp8", 0.04), ("tbq4", 0.12)])
def test_round_trip(fmt, tol):
    g = torch.Generator().manual_seed(1)
    c_kv, k_pe = torch.randn(50, 512, generator=g) * 3, torch.randn(50, 64, generator=g)
    back = decode_rows(fmt, encode_rows(fmt, c_kv, k_pe), 512, 64)
    assert rel_err(back[:, :512], c_kv) < tol
    if fmt == "fp8":  # each value within half a step (its 8-group's amax / 127 / 2) of the original
        step = k_pe.view(50, 8, 8).abs().amax(-1, keepdim=True) / 127
        assert ((back[:, 512:] - k_pe).view(50, 8, 8).abs() <= 0.5 * step * 1.001 + 1e-6).all()
        assert rel_err(back[:, 512:], k_pe) < 0.01
    else:
        assert torch.equal(back[:, 512:], k_pe.to(torch.bfloat16).float())  # rope part is bf16, exact


def test_rope_int8_groups_edge_cases():
    """Per-8 scales: a zero group codes to zeros (no division by zero), a group's largest value to ±127, groups of
    very different sizes keep their own precision, and the values come back within half a step."""
    k_pe = torch.randn(3, 16) * torch.tensor([1e-3] * 8 + [1e3] * 8)
    k_pe[1, :8] = 0.0
    k_pe[2, 3] = -5e3
    values, scale = rope_int8(k_pe)
    assert values.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (3, 2)
    assert (values[1, :8] == 0).all() and torch.isfinite(scale.float()).all() and (scale.float() > 0).all()
    assert values[2, 3] == -127 and (values.abs().amax(-1) >= 126).all()
    back = (values.float().view(3, 2, 8) * scale.float().view(3, 2, 1)).view(3, 16)
    assert ((back - k_pe).abs() <= 0.51 * scale.float().repeat_interleave(8, 1)).all()
    assert rel_err(back[0, :8], k_pe[0, :8]) < 0.01  # the small group is not swamped by the large one


def test_tbq4_rotated_domain_scores_equal_original_domain_scores():
    """Attention can stay rotated: (Hq)·codes equals q·dequantised, and H(Σ p·codes) = Σ p·dequantised."""
    g = torch.Generator().manual_seed(2)
    c_kv, q = torch.randn(40, 512, generator=g), torch.randn(3, 512, generator=g)
    codes = encode_rows("tbq4", c_kv, torch.zeros(40, 64))[:, : tbq4.row_bytes(512)]
    rot, orig = tbq4.dequantize_rotated(codes, 512), tbq4.dequantize(codes, 512)
    assert torch.allclose(tbq4.rotate_blocks(q) @ rot.T, q @ orig.T, atol=1e-4)
    p = torch.softmax(torch.randn(3, 40, generator=g), -1)
    assert torch.allclose(tbq4.rotate_blocks(p @ rot), p @ orig, atol=1e-5)


def decode_case(fmt, seed, B=4, S=2, H=16, T=300, page=16, scale=1.0, dc=512, dr=64):
    g = torch.Generator().manual_seed(seed)
    pages = B * (-(-T // page))
    c_kv = torch.randn(B * T, dc, generator=g) * scale
    k_pe = torch.randn(B * T, dr, generator=g)
    width, dtype = row_spec(fmt, dc, dr, torch.float32)
    cache = torch.zeros(pages, page, width, dtype=dtype)
    perm = torch.randperm(pages, generator=g)
    table = perm.view(B, -1).to(torch.int32)
    slots = torch.cat([(table[b].long()[:, None] * page + torch.arange(page)).flatten()[:T] for b in range(B)])
    write_kv_cache(cache, c_kv, k_pe, slots, fmt)
    q = torch.randn(B, S, H, dc + dr, generator=g)
    return q, cache, table, torch.full((B,), T, dtype=torch.int32)


# min cosine per (request, token) row, at two attention sharpnesses: softmax scale 1/√192 on unit
# random q, k (peaked: the top key takes ~13 % of the mass over 300 keys) and a flatter one.
# Measured (min / mean): fp8 0.9988 / 0.9991 and 0.9996 / 0.9996; tbq4 0.985 / 0.988 and
# 0.9948 / 0.9953 — the 0.999 / 0.995 hold for fp8 and for tbq4 on the flatter case's mean.
@pytest.mark.parametrize("fmt,scale,min_cos", [("fp8_ds_mla", 0.0721, 0.998), ("fp8_ds_mla", 0.02, 0.9995),
                                                ("fp8", 0.0721, 0.998), ("fp8", 0.02, 0.9995),
                                                ("tbq4", 0.0721, 0.98), ("tbq4", 0.02, 0.994)])
def test_attention_output_quality_against_the_unquantised_cache(fmt, scale, min_cos):
    q, ref_cache, table, seq = decode_case("auto", seed=3)
    _, cache, _, _ = decode_case(fmt, seed=3)
    want = mla_decode(q, ref_cache, table, seq, scale, backend="torch", head_dim_v=512)
    got = mla_decode(q, cache, table, seq, scale, backend="torch", head_dim_v=512, kv_format=fmt)
    cos = torch.nn.functional.cosine_similarity(got.flatten(2), want.flatten(2), dim=-1)
    assert cos.min().item() >= min_cos, cos.min()


def test_a_pool_of_fixed_bytes_holds_more_quantised_tokens():
    """The quantised formats' memory check on the embedded model (Dc 512, Dr 64): in the same bytes (the CPU
    budget, 1 GiB) the engine's pool holds 1152 / row bytes times the bf16 tokens: fp8 1.89×, fp8_ds_mla 1.76×,
    tbq4 2.88×."""
    from specmla.engine.engine import default_num_pages
    from specmla.model.default import default_model_path
    from specmla.model.loader import load_model

    model = load_model(default_model_path(), device="cpu", dtype=torch.bfloat16, progress=False)
    tokens = {f: 64 * default_num_pages(model, 64, torch.bfloat16, torch.device("cpu"), 1 << 20, 1 << 20, kv_format=f)
              for f in ("auto", "fp8_ds_mla", "fp8", "tbq4")}
    assert tokens["auto"] < 64 * (1 << 20) * (1 << 20) // 64  # the budget, not the request count, is the cap
    for fmt, row in (("fp8_ds_mla", 656), ("fp8", 608), ("tbq4", 400)):
        assert tokens[fmt] / tokens["auto"] == pytest.approx(1152 / row, rel=2e-3)


def test_bad_widths_are_rejected():
    cache = torch.zeros(4, 16, 600, dtype=torch.uint8)
    with pytest.raises(ValueError, match="width"):
        write_kv_cache(cache, torch.randn(2, 512), torch.randn(2, 64), torch.tensor([0, 1]), "fp8_ds_mla")


@pytest.fixture(scope="module")
def model_dc128(tmp_path_factory):
    """The small test model with kv_lora_rank 128 (quantised formats work in 128-wide blocks)."""
    from helpers.tiny_config import TINY_TEST_CONFIG

    from specmla.model.default import build_random_model_dir

    return build_random_model_dir(tmp_path_factory.mktemp("dc128") / "m", dict(TINY_TEST_CONFIG, kv_lora_rank=128))


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "tbq4"])
def test_engine_runs_on_a_quantised_cache(model_dc128, fmt):
    tiny_model_dir = model_dc128
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 3 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=256).generate(prompts, params)
    llm = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=256, kv_cache_dtype=fmt)
    assert llm.kv_pool.caches[0].dtype == torch.uint8
    outs = llm.generate(prompts, params)
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs, ref))
    print(f"{fmt}: {same}/8 greedy outputs equal the fp32-cache ones (random model, near-flat logits)")
    assert all(a.token_ids[0] == b.token_ids[0] for a, b in zip(outs, ref))  # prefill reads no cache
    assert same >= {"fp8_ds_mla": 6, "fp8": 6, "tbq4": 2}[fmt]
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
    poisoned = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=256, kv_cache_dtype=fmt)
    for c in poisoned.kv_pool.caches:
        c.fill_(255)
    assert [o.token_ids for o in poisoned.generate(prompts, params)] == [o.token_ids for o in outs]


def test_tbq4_engine_folds_the_rotation_into_the_weights(model_dc128, monkeypatch):
    """With a tbq4 cache every attention layer keeps kv_b_proj·R and decodes with rotated=True (no rotation
    launches); the greedy tokens are those of the unfolded decode (the rotation applied to q and the output)."""
    import specmla.model.deepseek as deepseek

    prompts = [[(5 * i + j) % 250 + 3 for j in range(4 + 2 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    calls = []
    real = deepseek.mla_decode
    monkeypatch.setattr(deepseek, "mla_decode", lambda *a, **k: calls.append(k["rotated"]) or real(*a, **k))
    folded = LLM(model_dc128, device="cpu", page_size=4, num_pages=256, kv_cache_dtype="tbq4")
    attns = [layer.self_attn for layer in list(folded.model.model.layers) + list(folded.model.mtp)]
    for attn in attns:
        assert attn.kv_b_rotated.shape == attn.kv_b_proj.weight.shape
        assert not torch.equal(attn.kv_b_rotated, attn.kv_b_proj.weight)
        assert "kv_b_rotated" not in dict(folded.model.named_parameters())  # not a checkpoint tensor
    got = folded.generate(prompts, params)
    assert calls and all(calls)
    plain = LLM(model_dc128, device="cpu", page_size=4, num_pages=256, kv_cache_dtype="tbq4")
    for layer in list(plain.model.model.layers) + list(plain.model.mtp):
        del layer.self_attn.kv_b_rotated
    calls.clear()
    want = plain.generate(prompts, params)
    assert calls and not any(calls)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "tbq4"])
@pytest.mark.parametrize("S,H,page", [(1, 16, 16), (3, 4, 64), (2, 1, 5)])
def test_triton_decode_reads_quantised_rows_directly(fmt, S, H, page):
    """The Triton kernel reading fp8 / tbq4 rows (tbq4: rotated-domain attention) equals the torch
    reference that dequantises the same rows first."""
    q, cache, table, seq = decode_case(fmt, seed=S + H, B=3, S=S, H=H, T=70, page=page)
    seq = torch.tensor([70, 5, 33], dtype=torch.int32)
    want, want_lse = mla_decode(q, cache, table, seq, 0.0721, backend="torch", head_dim_v=512, kv_format=fmt,
                                return_lse=True)
    got, got_lse = mla_decode(q, cache, table, seq, 0.0721, backend="triton", head_dim_v=512, kv_format=fmt,
                              return_lse=True)
    assert rel_err(got, want) < 1e-4
    assert (got_lse - want_lse).abs().max() < 1e-4


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "tbq4"])
@pytest.mark.parametrize("dc,dr,page", [(128, 32, 16), (384, 64, 8), (256, 16, 5)])
def test_triton_decode_quantised_other_latent_widths(fmt, dc, dr, page):
    """Other latent widths: 1 or 3 blocks of 128 (a block count that is not a power of two is
    padded and masked), padded tbq4 rows, rows whose stride allows no vector loads; with and
    without the next-block prefetch, both equal to the reference."""
    from specmla.ops.decode import triton as T

    q, cache, table, seq = decode_case(fmt, seed=dc + page, B=3, S=2, H=4, T=45, page=page, dc=dc, dr=dr)
    seq = torch.tensor([45, 1, 17], dtype=torch.int32)
    want, want_lse = mla_decode(q, cache, table, seq, 0.09, backend="torch", head_dim_v=dc, kv_format=fmt,
                                return_lse=True)
    for prefetch in (True, False):
        got, got_lse = mla_decode(q, cache, table, seq, 0.09, head_dim_v=dc, kv_format=fmt, return_lse=True,
                                  opts=T.Options(prefetch=prefetch))
        assert rel_err(got, want) < 1e-4
        seen = torch.isfinite(want_lse)  # a 1-token request's first query token sees no key: lse −inf
        assert torch.equal(seen, torch.isfinite(got_lse)) and not seen.all()
        assert (got_lse[seen] - want_lse[seen]).abs().max() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "tbq4"])
@pytest.mark.parametrize("dc,dr,page,S", [(512, 64, 64, 1), (512, 64, 16, 4), (384, 64, 8, 2), (128, 32, 5, 1)])
def test_gpu_quantised_decode_shapes(fmt, dc, dr, page, S):
    """The Triton kernel in bf16 on the GPU (tbq4: the PTX table lookup) against the fp32 reference, prefetch on
    and off."""
    from specmla.ops.decode import triton as T

    q, cache, table, seq = decode_case(fmt, seed=dc + S, B=5, S=S, H=16, T=333, page=page, dc=dc, dr=dr)
    seq = torch.tensor([333, 1, 64, 65, 200], dtype=torch.int32)
    want = mla_decode(q, cache, table, seq, 0.09, backend="torch", head_dim_v=dc, kv_format=fmt)
    for prefetch in (True, False):
        got = mla_decode(q.bfloat16().cuda(), cache.cuda(), table.cuda(), seq.cuda(), 0.09, head_dim_v=dc,
                         kv_format=fmt, opts=T.Options(prefetch=prefetch))
        assert rel_err(got.float().cpu(), want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "tbq4"])
def test_gpu_quantised_decode_bf16(fmt):
    q, cache, table, seq = decode_case(fmt, seed=9, B=6, S=2, H=16, T=700, page=64)
    q, cache, table, seq = q.bfloat16().cuda(), cache.cuda(), table.cuda(), seq.cuda()
    want = mla_decode(q.float().cpu(), cache.cpu(), table.cpu(), seq.cpu(), 0.0721, backend="torch", head_dim_v=512,
                      kv_format=fmt)
    got = mla_decode(q, cache, table, seq, 0.0721, head_dim_v=512, kv_format=fmt)  # the default route on CUDA
    # on Hopper tbq4 goes to its e4m3 kernel (centroids, q and P rounded to e4m3: 2-4 % from the exact attention)
    assert rel_err(got.float().cpu(), want) < (5e-2 if fmt == "tbq4" else 1e-2)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "tbq4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_write_kernel_matches_the_reference_write(fmt, dtype):
    """Triton pack + quantise + scatter (interpreter) vs the torch reference, from strided inputs
    (c_kv and k_pe as views of one kv_a output, as the model produces them); fp32 latents and the model's bf16."""
    from specmla.ops.kv_cache import write_kv_cache_triton

    g = torch.Generator().manual_seed(5)
    T, pages, page = 37, 6, 16
    latent = (torch.randn(T, 512 + 64, generator=g) * 2).to(dtype)
    c_kv, k_pe = latent[:, :512], latent[:, 512:]  # strided views
    slots = torch.randperm(pages * page, generator=g)[:T]
    width, dtype = row_spec(fmt, 512, 64, torch.float32)
    ref = torch.zeros(pages, page, width, dtype=dtype)
    got = torch.zeros_like(ref)
    write_kv_cache(ref, c_kv, k_pe, slots, fmt)
    write_kv_cache_triton(got, c_kv, k_pe, slots, fmt)
    untouched = torch.ones(pages * page, dtype=torch.bool)
    untouched[slots] = False
    assert (got.view(-1, width)[untouched] == 0).all()
    a = decode_rows(fmt, ref.view(-1, width)[slots], 512, 64)
    b = decode_rows(fmt, got.view(-1, width)[slots], 512, 64)
    # rounding is done with integer arithmetic in the kernel (RNE), so the bytes match exactly
    assert torch.equal(ref.view(-1, width)[slots], got.view(-1, width)[slots])
    assert torch.equal(a, b)



@pytest.mark.parametrize("dtype,dc,dr,T", [(torch.bfloat16, 512, 64, 37), (torch.float16, 96, 32, 5),
                                           (torch.float32, 512, 64, 1)])
def test_unquantised_write_kernel_equals_cat_and_index_copy(dtype, dc, dr, T):
    """One-kernel row writes (interpreter) from strided views, into a NaN-poisoned cache: the written rows equal
    the reference's bit for bit, every other row stays NaN."""
    from specmla.ops.kv_cache import write_kv_rows_triton

    g = torch.Generator().manual_seed(T)
    pages, page = 5, 16
    latent = (torch.randn(T, dc + dr, generator=g) * 3).to(dtype)
    c_kv, k_pe = latent[:, :dc], latent[:, dc:]
    slots = torch.randperm(pages * page, generator=g)[:T].to(torch.int32)
    ref = torch.full((pages, page, dc + dr), float("nan"), dtype=dtype)
    got = ref.clone()
    write_kv_cache(ref, c_kv, k_pe, slots.long(), "auto")
    write_kv_rows_triton(got, c_kv, k_pe, slots)
    assert torch.equal(got.view(-1, dc + dr)[slots.long()], ref.view(-1, dc + dr)[slots.long()])
    untouched = torch.ones(pages * page, dtype=torch.bool)
    untouched[slots.long()] = False
    assert got.view(-1, dc + dr)[untouched].isnan().all()
    # a strided slot mapping with a negative slot: that token is skipped
    wide = torch.stack([slots, torch.zeros_like(slots)], 1)[:, 0]
    wide[0] = -1
    again = torch.full_like(ref, float("nan"))
    write_kv_rows_triton(again, c_kv, k_pe, wide)
    assert torch.equal(again.view(-1, dc + dr)[slots[1:].long()], ref.view(-1, dc + dr)[slots[1:].long()])
    assert again.isnan().all(-1).sum().item() == pages * page - (T - 1)
    with pytest.raises(ValueError, match="dtype"):
        write_kv_rows_triton(got.to(torch.float16 if dtype != torch.float16 else torch.float32), c_kv, k_pe, slots)
    with pytest.raises(ValueError, match="width"):
        write_kv_rows_triton(got, c_kv[:, 1:], k_pe, slots)


@pytest.mark.gpu
def test_gpu_unquantised_write_kernel_is_exact():
    latent = torch.randn(300, 576, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    got = torch.full((64, 16, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    write_kv_cache(got, latent[:, :512], latent[:, 512:], slots, "auto")  # the kernel's path on CUDA
    assert torch.equal(got.view(-1, 576)[slots], latent)
    assert got.view(-1, 576).isnan().all(-1).sum().item() == 64 * 16 - 300


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8", "tbq4"])
def test_gpu_fused_write_is_byte_exact(fmt):
    from specmla.ops.kv_cache import write_kv_cache_triton

    latent = torch.randn(300, 576, device="cuda") * 2
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    width, dtype = row_spec(fmt, 512, 64, torch.float32)
    ref = torch.zeros(64, 16, width, dtype=dtype)
    got = torch.zeros(64, 16, width, dtype=dtype, device="cuda")
    write_kv_cache(ref, latent[:, :512].cpu(), latent[:, 512:].cpu(), slots.cpu(), fmt)
    write_kv_cache_triton(got, latent[:, :512], latent[:, 512:], slots, fmt)
    diff = (got.cpu() != ref).float().mean().item()
    assert diff < 1e-3  # tbq4 codes may flip where the GPU's FWHT matmul rounds differently


@pytest.mark.gpu
def test_gpu_writes_past_two_gib_of_latents():
    """Token t's latents sit t · 576 elements in: past 3.73M tokens that passes 2³¹, which the write kernels must
    address in 64 bits (a benchmark filling a whole cache at once writes that many)."""
    T, tail = 3_800_000, 300
    latent = torch.randn(T, 576, device="cuda", dtype=torch.bfloat16)
    assert (T - 1) * latent.stride(0) > 2**31
    # unquantised rows: every token but the last `tail` skipped (slot -1)
    slots = torch.full((T,), -1, dtype=torch.long, device="cuda")
    slots[-tail:] = torch.randperm(64 * 16, device="cuda")[:tail]
    got = torch.full((64, 16, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    write_kv_cache(got, latent[:, :512], latent[:, 512:], slots, "auto")
    assert torch.equal(got.view(-1, 576)[slots[-tail:]], latent[-tail:])
    # fp8 rows: every token written (the fused kernel skips none); the last ones against the reference writer
    width, dtype = row_spec("fp8", 512, 64, torch.float32)
    cache = torch.empty(T // 64 + 1, 64, width, dtype=dtype, device="cuda")
    write_kv_cache(cache, latent[:, :512], latent[:, 512:], torch.arange(T, device="cuda"), "fp8")
    ref = torch.zeros(tail // 64 + 1, 64, width, dtype=dtype)
    tail_latent = latent[-tail:].float().cpu()
    write_kv_cache(ref, tail_latent[:, :512], tail_latent[:, 512:], torch.arange(tail), "fp8")
    diff = (cache.view(-1, width)[T - tail:T].cpu() != ref.view(-1, width)[:tail]).float().mean().item()
    assert diff < 1e-3  # as test_gpu_fused_write_is_byte_exact: the latents read are the tokens' own


@triton.jit
def _cast_kernel(X, Y, Z, N: tl.constexpr):
    o = tl.arange(0, N)
    x = tl.load(X + o)
    tl.store(Y + o, _e4m3_rne(x))
    tl.store(Z + o, _bf16_rne(x))


@triton.jit
def _split_kernel(X, HI, MID, LO, N: tl.constexpr):
    o = tl.arange(0, N)
    x = tl.load(X + o)
    hi = _tf32_part(x)
    mid = _tf32_part(x - hi)
    tl.store(HI + o, hi)
    tl.store(MID + o, mid)
    tl.store(LO + o, x - hi - mid)


def test_tbq4_write_splits_fp32_into_tf32_exact_parts():
    """The tbq4 write's rotation operand: x = hi + mid + lo exactly, each part with its 13 low mantissa bits clear
    (exact in tf32), over signs, zeros and magnitudes from 2⁻¹⁰⁰ to 2¹⁰⁰."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-100, 100, (4096,), generator=g).float())
    x[:4] = torch.tensor([0.0, -0.0, 1.0, -3.0])
    hi, mid, lo = (torch.empty_like(x) for _ in range(3))
    _split_kernel[(1,)](x, hi, mid, lo, N=4096)
    assert torch.equal(hi.double() + mid.double() + lo.double(), x.double())
    for part in (hi, mid, lo):
        assert (part.view(torch.int32) & 0x1FFF == 0).all()
    assert (mid != 0).sum() > 3000 and (lo != 0).sum() > 500  # the parts carry bits (not all in hi)


def test_kernel_roundings_equal_torch_casts():
    """The fused write's integer-arithmetic RNE casts (fp32 → e4m3fn, fp32 → bf16) equal torch's on
    every e4m3 value, every midpoint between neighbours (ties), and random values."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    v = torch.sort(v[torch.isfinite(v)].unique()).values
    g = torch.Generator().manual_seed(0)
    x = torch.cat([v, (v[1:] + v[:-1]) / 2, torch.rand(3000, generator=g) * 896 - 448,
                   torch.randn(2000, generator=g) * 0.01])
    x = torch.cat([x, torch.ones(8192 - len(x))])
    y, z = torch.empty(8192, dtype=torch.uint8), torch.empty(8192, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, y, z, N=8192)
    nonzero = x != 0
    assert torch.equal(y[nonzero], x.to(torch.float8_e4m3fn).view(torch.uint8)[nonzero])
    assert torch.equal(z, x.to(torch.bfloat16))
