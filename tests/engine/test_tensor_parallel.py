"""Tensor parallelism on CPU: 2 gloo ranks give the same greedy tokens as one process."""

from specmla import LLM, SamplingParams
from specmla.model.default import default_model_path


def prompts(n=8):
    return [[(7 * i + j) % 250 + 3 for j in range(2 + 5 * i)] for i in range(n)]


def run(model_dir, tp, **kw):
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=512, tensor_parallel_size=tp, **kw)
    try:
        outs = llm.generate(prompts(), SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
        assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
        return [o.token_ids for o in outs]
    finally:
        llm.shutdown()


def test_tp2_equals_tp1_on_a_random_tiny_model(tiny_model_dir):
    assert run(tiny_model_dir, 2) == run(tiny_model_dir, 1)


def test_tp2_equals_tp1_on_the_embedded_model_with_mtp_speculation_and_fp8_cache():
    path = default_model_path()  # production latent shapes (Dc 512): fp8 rows apply (608 bytes, the int8 rope)
    kw = dict(speculative="mtp", num_speculative_tokens=2, kv_cache_dtype="fp8")
    assert run(path, 2, **kw) == run(path, 1, **kw)
