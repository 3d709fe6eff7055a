"""The tbq4 rotation kernels (`ops.tbq4_rotate`: the rotation, and the split combine that rotates back) against
their torch references, in the Triton interpreter on CPU and on the GPU: odd row and head counts, a tail past
`width` or none, in place, strided input, empty splits and rows, and the errors for a bad width or out shape."""

import pytest
import torch

from specmla.ops.kv_cache import tbq4
from specmla.ops.kv_cache.rotation import hadamard_signs, rotate_rows, rotate_rows_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_signs_are_the_scaled_orthonormal_hadamard():
    assert torch.allclose(hadamard_signs("cpu") / 128 ** 0.5, tbq4.hadamard("cpu"), atol=1e-6)


@pytest.mark.parametrize("shape,width", [((3, 1, 5, 576), 512), ((17, 256), 256), ((2, 2, 16, 384), 128),
                                         ((1, 640), 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotate_rows_matches_the_reference(shape, width, dtype):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype).to(DEVICE)
    want = rotate_rows_torch(x, width)
    got = rotate_rows(x, width)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * 3)
    assert torch.equal(got[..., width:], x[..., width:])  # the tail is copied bit for bit


def test_rotating_twice_gives_the_input_back():
    x = torch.randn(7, 512, device=DEVICE)
    assert torch.allclose(rotate_rows(rotate_rows(x, 512), 512), x, atol=1e-5)


def test_in_place_and_strided_input():
    torch.manual_seed(1)
    base = torch.randn(5, 3, 700, device=DEVICE)
    x = base[:, :, :576]  # rows 700 apart
    want = rotate_rows_torch(x, 512)
    assert torch.allclose(rotate_rows(x, 512), want, atol=1e-5)
    y = x.contiguous()
    out = rotate_rows(y, 512, out=y)
    assert out.data_ptr() == y.data_ptr() and torch.allclose(y, want, atol=1e-5)
    strided_out = torch.empty(5, 3, 700, device=DEVICE)[:, :, :576]
    rotate_rows(x, 512, out=strided_out)
    assert torch.allclose(strided_out, want, atol=1e-5)


def test_empty_input():
    x = torch.empty(0, 576, device=DEVICE)
    assert rotate_rows(x, 512).shape == (0, 576)


@pytest.mark.parametrize("width", [0, 100, 640])
def test_bad_width_is_refused(width):
    x = torch.randn(2, 576, device=DEVICE)
    before = x.clone()
    with pytest.raises(ValueError, match="width"):
        rotate_rows(x, width)
    assert torch.equal(x, before)


def test_bad_out_shape_is_refused():
    with pytest.raises(ValueError, match="out has shape"):
        rotate_rows(torch.randn(2, 512, device=DEVICE), 512, out=torch.empty(3, 512, device=DEVICE))


@pytest.mark.gpu
def test_rotate_rows_bf16_on_the_gpu():
    torch.manual_seed(2)
    x = torch.randn(32, 1, 16, 576, device="cuda", dtype=torch.bfloat16)
    want = rotate_rows_torch(x, 512)
    got = rotate_rows(x, 512)
    # both round the same fp32 result to bf16; tf32 dot of exact inputs may differ in the sums' order only
    assert (got.float() - want.float()).abs().max().item() <= 2 ** -7 * want.float().abs().max().item()
    assert torch.equal(got[..., 512:], x[..., 512:])


@pytest.mark.parametrize("B,S,H,ns", [(2, 1, 16, 3), (1, 2, 5, 4), (3, 1, 20, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_rotate_matches_the_reference(B, S, H, ns, dtype):
    from specmla.ops.kv_cache.rotation import combine_rotate, combine_rotate_torch

    torch.manual_seed(3)
    mid_o = torch.randn(B, S, H, ns, 512, device=DEVICE)
    mid_lse = torch.randn(B, S, H, ns, device=DEVICE) * 3
    mid_lse[0, 0, 0, 0] = float("-inf")  # an empty split
    if ns > 1:
        mid_lse[-1, -1, -1, :] = float("-inf")  # a row that saw no keys
    want_o, want_lse = torch.empty(B, S, H, 512, device=DEVICE, dtype=dtype), torch.empty(B, S, H, device=DEVICE)
    combine_rotate_torch(mid_o, mid_lse, want_o, want_lse)
    got_o, got_lse = torch.empty_like(want_o), torch.empty_like(want_lse)
    combine_rotate(mid_o, mid_lse, got_o, got_lse)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got_o.float(), want_o.float(), rtol=tol, atol=tol)
    assert torch.equal(got_lse.isinf(), want_lse.isinf())
    assert torch.allclose(got_lse[~got_lse.isinf()], want_lse[~want_lse.isinf()], atol=1e-5)


@pytest.mark.parametrize("B,H", [(2, 4), (1, 1)])
def test_decode_over_tbq4_with_splits_matches_the_reference(B, H):
    """mla_decode over a tbq4 cache with several splits (the combine rotates the output back where its programs
    fill half the SMs, else a plain combine and `rotate_rows`): both match the torch reference."""
    from specmla.ops import mla_decode
    from specmla.ops.decode import mla_decode_torch
    from specmla.ops.kv_cache import row_spec, write_kv_cache

    torch.manual_seed(4)
    page, lens = 16, [70, 130][:B]
    num_pages = 2 * 9 + 2  # table rows of 9 pages (130 keys need 9)
    latent = torch.randn(num_pages * page, 576, device=DEVICE)
    cache = torch.empty(num_pages, page, row_spec("tbq4", 512, 64, torch.float32)[0], dtype=torch.uint8, device=DEVICE)
    write_kv_cache(cache, latent[:, :512], latent[:, 512:], torch.arange(num_pages * page, device=DEVICE), "tbq4")
    table = torch.randperm(num_pages, device=DEVICE, dtype=torch.int32)[:18].view(2, 9)[:B]
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(B, 1, H, 576, device=DEVICE)
    ref = mla_decode_torch(q.double(), cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format="tbq4")
    for splits in (1, 3):
        out = mla_decode(q, cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format="tbq4", num_splits=splits,
                         backend="triton")
        assert torch.allclose(out.double(), ref, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_in_the_rotated_domain(backend):
    """rotated=True: q's latent part comes rotated and the output stays rotated (no rotation inside): the same
    attention as the plain call seen through the rotation, lse unchanged; other formats refuse it."""
    from specmla.ops import mla_decode
    from specmla.ops.kv_cache import row_spec, write_kv_cache

    torch.manual_seed(6)
    page, B, S, H = 16, 2, 2, 3
    num_pages = 2 * 6
    latent = torch.randn(num_pages * page, 576, device=DEVICE)
    cache = torch.empty(num_pages, page, row_spec("tbq4", 512, 64, torch.float32)[0], dtype=torch.uint8, device=DEVICE)
    write_kv_cache(cache, latent[:, :512], latent[:, 512:], torch.arange(num_pages * page, device=DEVICE), "tbq4")
    table = torch.randperm(num_pages, device=DEVICE, dtype=torch.int32).view(B, 6)
    seq = torch.tensor([90, 37], dtype=torch.int32, device=DEVICE)
    q = torch.randn(B, S, H, 576, device=DEVICE)
    want, want_lse = mla_decode(q, cache, table, seq, 576 ** -0.5, head_dim_v=512, kv_format="tbq4", backend=backend,
                                return_lse=True, num_splits=None if backend == "torch" else 2)
    got, got_lse = mla_decode(rotate_rows_torch(q, 512), cache, table, seq, 576 ** -0.5, head_dim_v=512,
                              kv_format="tbq4", backend=backend, return_lse=True, rotated=True,
                              num_splits=None if backend == "torch" else 2)
    assert not torch.allclose(got, want, atol=1e-2)  # the output is in the rotated domain
    assert torch.allclose(rotate_rows_torch(got, 512), want, atol=1e-4)
    assert torch.allclose(got_lse, want_lse, atol=1e-4)
    with pytest.raises(ValueError, match="rotated=True is for tbq4"):
        mla_decode(q, cache, table, seq, 0.1, head_dim_v=512, kv_format="fp8", rotated=True)
