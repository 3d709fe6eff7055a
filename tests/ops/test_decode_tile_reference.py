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
