"""kv_quant_quality's CPU side: the -kernel and -tile formats route the model's cache reads through their
emulations, whose perplexity stays beside the exact reads' on the embedded model."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kv_quant_quality as kq  # noqa: E402

from specmla import LLM  # noqa: E402


@pytest.mark.parametrize("exact,emulated", [("fp8", "fp8-tile"), ("tbq4", "tbq4-tile"), ("fp8", "fp8-kernel")])
def test_emulated_reads_go_through_the_emulation_and_keep_perplexity(exact, emulated):
    llm = LLM(None, device="cpu", dtype="float32")
    text = Path(kq.__file__).read_text()  # real Python source
    tokens = np.array(llm.tokenizer.encode(text)[:97], dtype=np.int64)
    with kq.kernel_reads(exact) as calls:
        nll_exact, n = kq.teacher_forced_nll(llm.model, tokens, exact)
    assert calls[0] == 0
    with kq.kernel_reads(emulated) as calls:
        nll, n2 = kq.teacher_forced_nll(llm.model, tokens, emulated)
    assert n == n2 == 96 and calls[0] == 12 * llm.model.config.num_hidden_layers  # 12 steps of S = 8, every trunk layer
    assert nll != nll_exact and abs(math.exp(nll / n) / math.exp(nll_exact / n) - 1) < 0.02
    assert kq.cache_format(emulated) == exact
