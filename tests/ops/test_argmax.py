import pytest
import torch

from specmla.ops.argmax import CHUNK, argmax_rows


@pytest.mark.parametrize("B,V", [(1, 7), (3, CHUNK), (2, 2 * CHUNK + 5), (5, 3 * CHUNK - 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_matches_torch(B, V, dtype):
    g = torch.Generator().manual_seed(B * 1000 + V)
    x = torch.randn(B, V, generator=g).to(dtype)
    assert torch.equal(argmax_rows(x, backend="triton"), x.argmax(-1))


def test_ties_take_the_first_index_across_chunks():
    V = 3 * CHUNK
    x = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    top = x.max() + 1
    x[0, [5, CHUNK + 2, 2 * CHUNK]] = top  # equal maxima in three chunks
    x[1, [CHUNK + 9, CHUNK + 3]] = top  # two in one chunk
    x[2] = float("-inf")  # every entry -inf: index 0, as torch
    x[3, [CHUNK - 1, 2 * CHUNK + 1]] = float("nan")  # NaN ranks above every number
    x[3, 7] = float("inf")  # ... +inf too, earlier in the row
    out = argmax_rows(x, backend="triton")
    assert out.tolist() == [5, CHUNK + 3, 0, CHUNK - 1]
    assert torch.equal(out, x.argmax(-1))


def test_inf_before_nan_in_one_chunk_and_all_nan_rows():
    x = torch.tensor([[1.0, float("inf"), float("nan"), 2.0], [float("nan")] * 4, [float("inf"), 0.0, 5.0, 1.0]])
    out = argmax_rows(x, backend="triton")
    assert out.tolist() == [2, 0, 0] and torch.equal(out, x.argmax(-1))


def test_strided_rows_and_empty_batch():
    wide = torch.randn(3, 2 * CHUNK + 40, generator=torch.Generator().manual_seed(2))
    x = wide[:, 17:CHUNK + 300]
    assert torch.equal(argmax_rows(x, backend="triton"), x.argmax(-1))
    assert argmax_rows(torch.empty(0, 10), backend="triton").shape == (0,)


def test_bad_shape():
    with pytest.raises(ValueError, match="argmax_rows"):
        argmax_rows(torch.randn(10), backend="triton")
    with pytest.raises(ValueError, match="argmax_rows"):
        argmax_rows(torch.randn(2, 0), backend="triton")


@pytest.mark.gpu
def test_gpu_argmax_at_the_vocabulary_size():
    x = torch.randn(8, 102400, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    xf = x.float()
    assert torch.equal(argmax_rows(xf), xf.argmax(-1))
