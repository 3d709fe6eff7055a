"""The streaming probe's kernel (benchmarks/l2_prefetch_probe.py) against its torch reference, in the interpreter
without the L2 prefetch (inline PTX, GPU only): the XOR fold of each program's pages."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import l2_prefetch_probe as L  # noqa: E402


@pytest.mark.parametrize("unroll", [True, False])
def test_stream_folds_each_programs_pages(unroll):
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cache = torch.randint(-2**31, 2**31 - 1, (11, L.WORDS), dtype=torch.int32, device=dev)
    table = torch.randperm(11, dtype=torch.int32, device=dev)[:8].view(2, 4)  # pages out of order, some unused
    out = torch.zeros(2 * 2 * (L.CHUNK + 128), dtype=torch.int32, device=dev)
    L.stream(cache, table, out, 2, 0, unroll)
    want = L.reference(cache, table, 2)
    assert want.abs().sum() > 0
    assert torch.equal(out[:4 * L.CHUNK].view(4, L.CHUNK), want)
