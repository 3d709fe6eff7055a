"""The torch emulation of dequant_seesaw's rounding (`ops.decode.hopper.tile_reference`), on the CPU: its tile rows
are the dequantised rows rounded to bf16 once (tbq4: in the rotated domain), and its attention stays within bf16
rounding of the exact reference, with NaN-poisoned tails."""

import pytest
import torch
from helpers.decode_kernels import poisoned_case, quant_case
from helpers.mla_cases import rel_err

from specmla.ops.decode.hopper.tile_reference import mla_decode_tiles, tile_rows
from specmla.ops.kv_cache.reference import decode_rows
from specmla.ops.kv_cache.rotation import rotate_rows_torch


@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla", "tbq4"])
def test_tile_rows_are_the_dequantised_rows_rounded_once(fmt):
    """The latent part in fp16 (tbq4: rotated), within fp16's rounding of the exact rows; the rope part the exact rope
    in bf16."""
    _, cache, _ = quant_case(fmt, seed=3, B=2, S=1, H=4, T=100, page=16)
    rows = cache.view(-1, cache.shape[-1])[:200]
    tiles = tile_rows(fmt, rows, 512, 64)
    exact = decode_rows(fmt, rows, 512, 64).float()
    assert tiles.dtype == torch.float32 and tiles.shape == (200, 576)
    latent = tiles[:, :512]
    assert torch.equal(tiles[:, 512:], exact[:, 512:].bfloat16().float())
    if fmt == "tbq4":  # rotating the latent part back gives the rows within fp16's rounding
        back = rotate_rows_torch(latent, 512)
        assert 0 < rel_err(back, exact[:, :512]) < 2e-3
    else:  # code · scale with the scale in fp16: within two fp16 roundings of the exact value
        err = (latent - exact[:, :512]).abs()
        assert (err <= exact[:, :512].abs() * 2 ** -10 + 2 ** -24).all() and err.max() > 0


@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla", "tbq4"])
@pytest.mark.parametrize("S,H,lens,causal", [(4, 16, [333, 1, 65], True), (1, 7, [70, 9], False), (3, 5, [2, 40], True)])
def test_emulation_is_the_reference_within_bf16_rounding(fmt, S, H, lens, causal):
    q, cache, table, seq, want, want_lse = poisoned_case(fmt, S * 11 + H, lens, S, H, 16, causal)
    got, got_lse = mla_decode_tiles(q, cache, table, seq, 0.0721, kv_format=fmt, causal=causal, return_lse=True)
    assert got.shape == want.shape and not got.isnan().any()
    err = rel_err(got, want)
    assert 0 < err < 1e-2, err
    seen = torch.isfinite(want_lse)  # the lse: -inf exactly where no key is seen, else within the keys' rounding
    assert got_lse.shape == want_lse.shape and torch.equal(torch.isfinite(got_lse), seen)
    assert 0 < (got_lse[seen] - want_lse[seen]).abs().max() < 2e-2
    empty = want.flatten(2).norm(dim=-1) == 0  # tokens before the request's first key
    assert (got.flatten(2)[empty] == 0).all()


def test_emulation_refuses_unquantised_caches():
    q, cache, table = quant_case("fp8", seed=1, B=1, S=1, H=2, T=16, page=16)
    with pytest.raises(ValueError, match="quantised formats"):
        mla_decode_tiles(q, cache, table, torch.tensor([16], dtype=torch.int32), 0.1, kv_format="bf16")


@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla"])
def test_e4m3_scores_follow_q_in_e4m3_terms(fmt):
    """`fp8_folded`'s scores (q in e4m3 terms against the exact codes, each chunk's partial times the key's fp32
    scale): with q in two terms they are the exact scores within 2⁻⁷ of their spread (0.3 % measured), in one term
    within a fifth of it (11 % measured: q's own rounding to 3 mantissa bits); the
    NaN-poisoned rows past each end are hidden."""
    from specmla.ops.decode.hopper.tile_reference import e4m3_codes, e4m3_latent_scores

    q, cache, table, seq, want, want_lse = poisoned_case(fmt, 29, [333, 1, 65], 4, 16, 16, True)
    rows = cache[table.long()].view(3, -1, cache.shape[-1])
    exact = torch.einsum("bshd,bld->bshl", q[..., :512].bfloat16().double(),
                         decode_rows(fmt, rows.reshape(-1, rows.shape[-1]), 512, 64).double()[:, :512]
                         .view(3, -1, 512))
    valid = torch.arange(rows.shape[1])[None, :] < seq[:, None]
    spread = exact[valid[:, None, None].expand_as(exact)].std()
    for split, bound in ((True, 2 ** -7), (False, 0.2)):
        got = e4m3_latent_scores(q[..., :512].bfloat16().float(), *e4m3_codes(fmt, rows, 512), q_split=split).double()
        err = (got - exact)[valid[:, None, None].expand_as(exact)].abs()
        assert 0 < err.max() < bound * spread
    out, lse = mla_decode_tiles(q, cache, table, seq, 0.0721, kv_format=fmt, return_lse=True, e4m3_scores=True,
                                q_split=True)
    seen = torch.isfinite(want_lse)
    assert not out.isnan().any() and torch.equal(torch.isfinite(lse), seen)
    assert rel_err(out, want) < 1e-2


def test_e4m3_scores_on_tbq4_rows():
    """tbq4 through `fp8_folded`'s rounding (codes as e4m3 centroid·k, norm / k as their scale; q rotated, then in two
    e4m3 terms): within 4 % of the exact reference and of `dequant_seesaw`'s emulation (2.0 % here: the e4m3
    centroids are within 2 % of the exact ones; the 16-row e4m3 kernel's emulation is 3.5 % off on this case)."""
    q, cache, table, seq, want, want_lse = poisoned_case("tbq4", 31, [333, 1, 65], 4, 16, 16, True)
    out, lse = mla_decode_tiles(q, cache, table, seq, 0.0721, kv_format="tbq4", return_lse=True, e4m3_scores=True,
                                q_split=True)
    tile = mla_decode_tiles(q, cache, table, seq, 0.0721, kv_format="tbq4")
    seen = torch.isfinite(want_lse)
    assert not out.isnan().any() and torch.equal(torch.isfinite(lse), seen)
    assert rel_err(out, want) < 4e-2
    assert 0 < rel_err(out, tile) < 4e-2
