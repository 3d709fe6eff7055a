"""Tensor parallelism: every rank runs the same engine on its shard; rank 0 forwards the request stream.

CPU (gloo ranks): greedy and seeded sampling under TP=2 / TP=4 give the tokens of one process, with every
speculative mode and KV format, with FP8 block-scaled weights, and with requests added and aborted between steps.
GPU (NCCL, CUDA graphs on every rank): the same in fp32."""

import pytest
import torch

from helpers.fp8_checkpoint import fp8_checkpoint_dir
from helpers.tiny_config import FP8_TP_TEST_CONFIG
from specmla import LLM, SamplingParams
from specmla.model.default import build_random_model_dir, default_model_path


def prompts(n=8):
    return [[(7 * i + j) % 250 + 3 for j in range(2 + 5 * i)] for i in range(n)]


def run(model_dir, tp, params=None, n=8, device="cpu", **kw):
    kw = dict(dict(page_size=4, num_pages=512) if device == "cpu" else {}, **kw)
    llm = LLM(model_dir, device=device, tensor_parallel_size=tp, **kw)
    try:
        params = params or SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts(n), params)
        assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
        return [o.token_ids for o in outs]
    finally:
        llm.shutdown()


def test_tp2_equals_tp1_on_a_random_tiny_model(tiny_model_dir):
    assert run(tiny_model_dir, 2) == run(tiny_model_dir, 1)


@pytest.fixture(scope="module")
def fp8_tp_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8_tp")
    return fp8_checkpoint_dir(build_random_model_dir(base / "src", FP8_TP_TEST_CONFIG, seed=3), base / "fp8")


def test_tp2_equals_tp1_on_an_fp8_checkpoint(fp8_tp_dir):
    """Each rank keeps its slices of the e4m3 weights and their block scales (fp32 activations, the weights
    dequantised in the product on CPU): TP=2 gives one process's greedy tokens."""
    assert run(fp8_tp_dir, 2) == run(fp8_tp_dir, 1)


def test_tp4_equals_tp1_with_seeded_sampling(tiny_model_dir):
    """Sampling draws from each request's seed: the same seeds give the same tokens on 4 ranks as on one."""
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(8)]
    assert run(tiny_model_dir, 4, params) == run(tiny_model_dir, 1, params)


@pytest.mark.parametrize("kw", [
    dict(speculative="mtp", num_speculative_tokens=2, kv_cache_dtype="fp8"),
    dict(speculative="ngram", num_speculative_tokens=3, kv_cache_dtype="tbq4"),
    dict(speculative="hybrid", num_speculative_tokens=2, kv_cache_dtype="fp8_ds_mla"),
], ids=["mtp-fp8", "ngram-tbq4", "hybrid-fp8_ds_mla"])
def test_tp2_equals_tp1_on_the_embedded_model_with_speculation_and_quantised_caches(kw):
    path = default_model_path()  # production latent shapes (Dc 512): the quantised row formats apply
    assert run(path, 2, n=5, **kw) == run(path, 1, n=5, **kw)


def test_tp_engine_refuses_writes_and_a_custom_tokenizer(tiny_model_dir):
    """Rank 0's engine attributes cannot be set (that would change rank 0 only), and a tokenizer object cannot
    be passed (the other ranks load the directory's); both raise before any rank diverges."""
    from specmla.tokenizer import Tokenizer

    with pytest.raises(ValueError, match="tokenizer"):
        LLM(tiny_model_dir, device="cpu", tensor_parallel_size=2, tokenizer=Tokenizer(tiny_model_dir))
    llm = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=64, tensor_parallel_size=2)
    try:
        with pytest.raises(AttributeError, match="every rank must stay identical"):
            llm.engine.max_model_len = 8
        assert llm.engine.max_model_len == llm.engine._engine.max_model_len > 8
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))[0]
        assert len(out.token_ids) == 3
    finally:
        llm.shutdown()


def test_tp_leaves_no_files_behind(tiny_model_dir):
    """The shared-memory channel's file goes once the workers have mapped it, the rendezvous file at shutdown."""
    import glob
    import tempfile

    def files():
        return set(glob.glob("/dev/shm/specmla-tp-*")) | set(glob.glob(f"{tempfile.gettempdir()}/specmla-tp-*"))

    before = files()
    llm = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=64, tensor_parallel_size=2)
    try:
        assert not {f for f in files() - before if f.startswith("/dev/shm/")}  # unlinked after the rendezvous
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    finally:
        llm.shutdown()
    assert files() - before == set()
    with pytest.raises(RuntimeError, match="stopped"):
        llm.engine.step()


def test_tp2_follows_requests_added_and_aborted_between_steps(tiny_model_dir):
    """A stream like a server's: requests join while others run, one is aborted mid-way; TP=2 gives each request
    the tokens TP=1 gives it, and the aborted one stops at the same length."""

    def stream(tp):
        llm = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=512, tensor_parallel_size=tp)
        try:
            eng, p = llm.engine, prompts(6)
            greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
            seqs = [eng.add_request(p[0], greedy), eng.add_request(p[1], greedy)]
            for step in range(40):
                if step == 3:
                    seqs += [eng.add_request(p[2], greedy), eng.add_request(p[3], SamplingParams(
                        max_tokens=20, temperature=0.8, seed=7, ignore_eos=True))]
                if step == 6:
                    assert eng.abort(seqs[1])
                if step == 9:
                    seqs.append(eng.add_request(p[4], greedy))
                if eng.has_unfinished():
                    eng.step()
            assert not eng.has_unfinished()
            return [(s.output_ids, s.finish_reason) for s in seqs]
        finally:
            llm.shutdown()

    one, two = stream(1), stream(2)
    assert two == one
    assert one[1][1] == "abort" and 0 < len(one[1][0]) < 20


@pytest.mark.gpu
@pytest.mark.parametrize("tp,kw", [(2, {}), (2, dict(speculative="mtp", num_speculative_tokens=2)), (4, {})],
                         ids=["tp2-plain", "tp2-mtp", "tp4-plain"])
def test_gpu_tp_with_graphs_on_every_rank_equals_tp1_in_fp32(tp, kw):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    path = default_model_path()
    common = dict(device="cuda", dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.3, **kw)
    one = run(path, 1, n=6, **common)
    many = run(path, tp, n=6, **common)
    assert many == one


@pytest.mark.gpu
def test_gpu_tp2_of_the_fp8_embedded_model_with_graphs_equals_tp1_in_fp32(tmp_path):
    """The embedded model as an FP8 checkpoint (every TP = 2 cut on the 128-blocks): each rank runs its e4m3 slices
    and scales through the GPU's FP8 kernels, graphs on both ranks; fp32 activations, so TP = 2 gives TP = 1's
    greedy tokens, with and without MTP drafts."""
    from specmla.model.default import ASSETS

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    fp8_dir = fp8_checkpoint_dir(ASSETS, tmp_path / "fp8", shard_bytes=10 ** 12)
    for kw in ({}, dict(speculative="mtp", num_speculative_tokens=2)):
        common = dict(device="cuda", dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.3, **kw)
        assert run(fp8_dir, 2, n=6, **common) == run(fp8_dir, 1, n=6, **common)


def test_tp2_unseeded_sampling_equals_tp1_with_the_seeds_rank_0_drew(tiny_model_dir):
    """No seed given: rank 0 draws one per request and sends it along. Its tokens are those of one process given
    the same seeds; a worker that sampled other tokens would feed other embeddings into the all-reduces."""
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    llm = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=512, tensor_parallel_size=2)
    try:
        seqs = [llm.engine.add_request(p, params) for p in prompts()]
        while llm.engine.has_unfinished():
            llm.engine.step()
        two = [s.output_ids for s in seqs]
    finally:
        llm.shutdown()
    seeded = [SamplingParams(max_tokens=16, temperature=1.0, seed=s.seed, ignore_eos=True) for s in seqs]
    assert two == run(tiny_model_dir, 1, seeded)


_CUT_SHORT = """
import sys
from specmla import LLM, SamplingParams

def main():
    llm = LLM(sys.argv[1], device="cpu", page_size=4, num_pages=128, tensor_parallel_size=2)
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    llm.model.model.layers[1].forward = interrupted  # rank 0 only: the worker waits in this layer's all-reduce
    try:
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0))
    except KeyboardInterrupt:
        print("interrupted", flush=True)

if __name__ == "__main__":
    main()
"""


def test_rank_0_exits_after_a_step_cut_short(tiny_model_dir, tmp_path):
    """Ctrl-C on rank 0 mid-step leaves the worker inside a collective, where no stop message reaches it: rank 0's
    exit kills it instead of waiting (multiprocessing's exit handler would join a worker that ignores SIGTERM)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "cut_short.py"
    script.write_text(_CUT_SHORT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, str(script), str(tiny_model_dir)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0 and "interrupted" in r.stdout, r.stderr[-2000:]


class _Pipe:
    """An in-process channel: what TPEngine sends, follow_engine receives (a thread each)."""

    def __init__(self):
        import queue

        self.q = queue.Queue()

    def send(self, data):
        self.q.put(data)

    def recv(self):
        return self.q.get(timeout=60)


def test_follower_stops_when_its_requests_drift_from_rank_0s(tiny_model_dir):
    """follow_engine on the same model as rank 0 follows it step for step; on a model whose weights differ (as a
    rank whose step failed would differ), it raises at the first step after the outputs part, instead of going on
    with other batches than rank 0's. Two full single-process engines stand in for the ranks (no collectives)."""
    import threading

    from specmla.engine.tp_worker import TPEngine, follow_engine

    def follow(perturb: bool):
        lead = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=128)
        other = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=128)
        if perturb:
            with torch.no_grad():
                other.model.lm_head.weight.mul_(-1.0)  # other tokens from the first sample on
        pipe, err = _Pipe(), []

        def run():
            try:
                follow_engine(other.engine, pipe)
            except BaseException as e:
                err.append(e)

        t = threading.Thread(target=run)
        t.start()
        eng = TPEngine(lead.engine, pipe)
        greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        seqs = [eng.add_request(p, greedy) for p in prompts(3)]
        while eng.has_unfinished() and not err:
            eng.step()
            t.join(timeout=0.05)
        eng.shutdown()
        t.join(timeout=60)
        assert not t.is_alive()
        return [s.output_ids for s in seqs], (err[0] if err else None)

    outs, err = follow(perturb=False)
    assert err is None and all(len(o) == 6 for o in outs)
    _, err = follow(perturb=True)
    assert isinstance(err, RuntimeError) and "no longer match rank 0" in str(err), err


def test_tp2_on_random_dummy_weights_keeps_the_ranks_in_step_and_frees_the_llm_at_shutdown(tmp_path):
    """load_format="dummy": each rank builds its shard from config.json alone, FP8 as the config says, and the TP
    engine runs it with MTP drafts, greedy decoding deterministic from run to run (that the replicated tensors are
    equal on every rank is tests/model/test_dummy.py's). After shutdown nothing of the group keeps the LLM (its
    weights) alive."""
    import gc
    import json
    import weakref

    from specmla.config import FP8_QUANTIZATION

    cfg = dict(FP8_TP_TEST_CONFIG, quantization_config=FP8_QUANTIZATION)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    kw = dict(load_format="dummy", speculative="mtp", num_speculative_tokens=2)
    first = run(tmp_path, 2, n=4, **kw)
    assert first == run(tmp_path, 2, n=4, **kw) and len({tuple(t) for t in first}) > 1
    llm = LLM(tmp_path, device="cpu", tensor_parallel_size=2, page_size=4, num_pages=64, load_format="dummy")
    assert llm.model.model.layers[1].mlp.w_down.dtype == torch.float8_e4m3fn
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    llm.shutdown()
    ref = weakref.ref(llm)
    del llm
    gc.collect()
    assert ref() is None
