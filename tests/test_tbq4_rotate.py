"""The tbq4 rotation kernel (`ops.tbq4_rotate`) against its torch reference, in the Triton interpreter on CPU (fp32
and fp16: the interpreter's bf16 dot is wrong) and on the GPU in bf16: odd row counts, a tail past `width` or none,
in place, strided input, and the errors for a bad width or out shape."""

import pytest
import torch

from specmla.ops import tbq4
from specmla.ops.tbq4_rotate import hadamard_signs, rotate_rows, rotate_rows_torch

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
