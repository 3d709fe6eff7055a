"""ops.scratch.zeroed_scratch: per-purpose counters that kernels leave at zero; graphs get a buffer allocated
outside any capture."""

import pytest
import torch

from specmla.ops import scratch


def test_cpu_buffer_is_reused_zeroed_and_grows():
    a = scratch.zeroed_scratch("test_cpu", 5, torch.device("cpu"))
    assert a.dtype == torch.int32 and a.numel() == 5 and (a == 0).all()
    assert scratch.zeroed_scratch("test_cpu", 3, "cpu") is a  # a smaller request takes the same buffer
    b = scratch.zeroed_scratch("test_cpu", 9, "cpu")
    assert b.numel() == 9 and (b == 0).all()
    assert scratch.zeroed_scratch("test_cpu_other", 5, "cpu") is not b  # one buffer per purpose


@pytest.mark.gpu
def test_gpu_capture_takes_the_graph_buffer_made_outside_the_capture():
    dev = torch.device("cuda")
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            scratch.zeroed_scratch("test_never_eager", 4, dev)
    eager = scratch.zeroed_scratch("test_gpu", 4, dev)
    got = []
    for _ in range(2):  # two graphs in two memory pools get the same buffer, allocated before either
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got.append(scratch.zeroed_scratch("test_gpu", 4, dev))
    assert got[0] is got[1] and got[0] is not eager and (got[0] == 0).all()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # eager launches on another stream get their own
        assert scratch.zeroed_scratch("test_gpu", 4, dev) is not eager
    assert scratch.zeroed_scratch("test_gpu", 4, dev) is eager
