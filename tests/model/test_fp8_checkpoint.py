"""FP8 block-scaled checkpoints (DeepSeek-V3's published format) load and run: weights stay float8_e4m3fn with their
block scales, the model matches transformers' DeepseekV3 on the dequantised weights, MTP layers included."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specmla.config import ModelConfig, UnsupportedModelError
from specmla.model.deepseek import DeepseekForCausalLM, MoE, checkpoint_name
from specmla.model.fp8 import Fp8Linear, use_fp8_weights_
from specmla.model.loader import CheckpointError, load_model, save_tensors
from specmla.model.metadata import AttentionMetadata
from specmla.ops.linear import fp8_block_linear
from helpers.fp8_checkpoint import dequantized_dir, fp8_checkpoint_dir, quantized, read_checkpoint
from helpers.hf_models import V3_BASE, build_hf_model, save_hf_model

# dims past one 128 block and not multiples of 128: partial edge blocks on both axes of every quantised weight,
# padded expert widths (136 → 256)
FP8_V3 = dict(V3_BASE, hidden_size=160, intermediate_size=200, moe_intermediate_size=136, q_lora_rank=144,
              kv_lora_rank=48, num_hidden_layers=3, first_k_dense_replace=1)
_DIRS: dict = {}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(fp8 directory, its dequantised fp32 twin); written once, never modified."""
    if not _DIRS:
        base = tmp_path_factory.mktemp("fp8")
        hf = build_hf_model("v3", FP8_V3, seed=5, std=0.06)
        with torch.no_grad():  # decisive routing: the w8a8 path's activation rounding must not flip expert choices
            for layer in hf.model.layers[FP8_V3["first_k_dense_replace"]:]:
                layer.mlp.gate.weight.mul_(4.0)
        save_hf_model(hf, str(base / "src"), max_shard_size="300KB", mtp_layers=1, seed=5)
        _DIRS["fp8"] = fp8_checkpoint_dir(base / "src", base / "fp8")
        _DIRS["deq"] = dequantized_dir(base / "fp8", base / "deq")
    yield _DIRS["fp8"], _DIRS["deq"]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _ids(vocab, n, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    T = ids.shape[0]
    meta = AttentionMetadata.for_contiguous([T], device=ids.device)
    with torch.no_grad():
        return model.compute_logits(model(ids, meta))


@pytest.fixture(scope="module")
def embedded_fp8_dir(tmp_path_factory):
    """The trained embedded model quantised as DeepSeek's FP8 checkpoints are (written once, never modified)."""
    from specmla.model.default import ASSETS

    return fp8_checkpoint_dir(ASSETS, tmp_path_factory.mktemp("embedded") / "fp8", shard_bytes=10 ** 12)


def _code_prompts(tokenizer, n: int) -> list[list[int]]:
    """n code prompts of growing length: slices of the json encoder's source."""
    import inspect
    import json as json_module

    src = inspect.getsource(json_module.encoder)
    return [tokenizer.encode(src[300 * i: 300 * i + 30 + 41 * i]) for i in range(n)]


def test_fp8_directory_keeps_float8_weights_with_their_scales(dirs):
    fp8_dir, _ = dirs
    model = load_model(fp8_dir, device="cpu", progress=False)
    stored = read_checkpoint(fp8_dir)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_a_proj, Fp8Linear) and isinstance(attn.o_proj, Fp8Linear)
    assert torch.equal(attn.q_a_proj.weight.view(torch.uint8),
                       stored["model.layers.0.self_attn.q_a_proj.weight"].view(torch.uint8))
    assert torch.equal(attn.q_a_proj.weight_scale_inv, stored["model.layers.0.self_attn.q_a_proj.weight_scale_inv"])
    # kv_b_proj dequantised at load (absorbed decode), the router and norms as stored
    assert attn.kv_b_proj.weight.dtype == torch.float32
    assert isinstance(model.model.layers[0].mlp.gate_proj, Fp8Linear)  # the dense MLP
    moe = model.model.layers[1].mlp
    assert isinstance(moe, MoE) and moe.w_gate_up.dtype == torch.float8_e4m3fn and moe.inter_padded == 256
    assert moe.gate.weight.dtype == torch.float32
    # the expert stacks' padding is zero; the real rows are the checkpoint's bytes
    I = moe.inter
    assert not moe.w_gate_up[:, I:256].float().any() and not moe.w_gate_up[:, 256 + I:].float().any()
    assert not moe.w_down[..., I:].float().any()
    assert torch.equal(moe.w_down[3, :, :I].view(torch.uint8),
                       stored["model.layers.1.mlp.experts.3.down_proj.weight"].view(torch.uint8))
    assert isinstance(model.mtp[0].self_attn.q_b_proj, Fp8Linear) and model.mtp[0].mlp.w_down_scale is not None
    deq = load_model(fp8_dir, device="cpu", dtype=torch.bfloat16, progress=False, weights="dequantize")
    assert not any(p.dtype == torch.float8_e4m3fn for p in deq.parameters())


def test_moe_fp8_padding_is_zeroed_and_real_rows_kept():
    """`MoE.use_fp8_` pads each expert's width to a multiple of 128; `zero_padding_` clears exactly the padding
    (gate and up rows, down columns, the shared experts' too), whatever the memory held (NaN here)."""
    cfg = ModelConfig.from_dict(dict(V3_BASE, architectures=["DeepseekV3ForCausalLM"], hidden_size=160,
                                     moe_intermediate_size=136, n_shared_experts=2))
    moe = MoE(cfg)
    moe.use_fp8_()
    I, Ip, Is, Isp = moe.inter, moe.inter_padded, moe.shared_inter, moe.shared_down.shape[1]
    assert (Ip, Is, Isp) == (256, 272, 384)
    stacks = (moe.w_gate_up, moe.w_down, moe.shared_gate_up, moe.shared_down)
    for t in stacks:
        t.data.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
    moe.zero_padding_()
    gu = moe.w_gate_up.float().view(-1, 2, Ip, 160)
    assert not gu[:, :, I:].any() and gu[:, :, :I].isnan().all()
    assert not moe.w_down.float()[..., I:].any() and moe.w_down.float()[..., :I].isnan().all()
    sgu = moe.shared_gate_up.float().view(2, Isp, 160)
    assert not sgu[:, Is:].any() and sgu[:, :Is].isnan().all()
    assert not moe.shared_down.float()[:, Is:].any() and moe.shared_down.float()[:, :Is].isnan().all()
    views = moe.checkpoint_tensors()  # the checkpoint's per-expert views skip the padding
    assert views["experts.1.up_proj.weight"].shape == (I, 160) and views["experts.1.down_proj.weight"].shape == (160, I)
    assert views["experts.1.up_proj.weight_scale_inv"].shape == (2, 2)
    assert views["shared_experts.up_proj.weight"].shape == (Is, 160)
    assert views["shared_experts.down_proj.weight_scale_inv"].shape == (2, 3)


def test_bad_weights_option_and_fp8_tensor_parallel_off_the_blocks_are_refused(dirs):
    """A weights option other than WEIGHTS is refused. FP8_V3's heads are 32 wide, so TP=2 gives each rank 64 of
    q_b_proj's 128 rows, inside one scale block: refused (weights='dequantize' named), and the dequantised model
    shards."""
    from specmla import LLM

    fp8_dir, _ = dirs
    with pytest.raises(ValueError, match="weights="):
        load_model(fp8_dir, device="cpu", progress=False, weights="fp8")
    with pytest.raises(ValueError, match="weights="):
        LLM(fp8_dir, device="cpu", weights="bogus")
    with pytest.raises(ValueError, match="q_b_proj: FP8 width 128 .*tensor_parallel_size=2.*weights='dequantize'"):
        load_model(fp8_dir, device="cpu", progress=False, shard=(0, 2))
    part = load_model(fp8_dir, device="cpu", progress=False, shard=(1, 2), weights="dequantize")
    assert part.model.layers[0].self_attn.num_heads == 2


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_v3_shaped_fp8_model_weighs_about_half_of_bf16():
    """DeepSeek-V3's shapes (61 layers + 1 MTP layer, 256 experts) on the meta device: the FP8 model's weights
    (e4m3 + fp32 block scales; embedding, head, norms, router, kv_b_proj and eh_proj in bf16) weigh ≤ 0.53× the
    bf16 model's."""
    cfg = ModelConfig(num_nextn_predict_layers=1)
    with torch.device("meta"):
        bf16 = DeepseekForCausalLM(cfg).to(torch.bfloat16)
        names = {n for n, t in bf16.checkpoint_tensors().items() if quantized(n, t)}
        fp8 = DeepseekForCausalLM(cfg).to(torch.bfloat16)
        use_fp8_weights_(fp8, {n + "_scale_inv" for n in names},
                         lambda name: checkpoint_name(name, cfg.num_hidden_layers))
    ratio = _weight_bytes(fp8) / _weight_bytes(bf16)
    print(f"V3-shaped weights: fp8 {_weight_bytes(fp8) / 1e9:.1f} GB, bf16 {_weight_bytes(bf16) / 1e9:.1f} GB, "
          f"ratio {ratio:.3f}")
    assert 0.45 < ratio <= 0.53


def test_fp8_model_matches_transformers_on_the_dequantised_weights(dirs):
    """CPU (the reference GEMMs: dequantised weights, fp32) against transformers' DeepseekV3 loaded from the
    dequantised directory, fp32: rel ≤ 1e-4; `weights="dequantize"` gives the same model."""
    from transformers import AutoModelForCausalLM

    fp8_dir, deq_dir = dirs
    oracle = AutoModelForCausalLM.from_pretrained(deq_dir, torch_dtype=torch.float32).eval()
    model = load_model(fp8_dir, device="cpu", progress=False)
    deq = load_model(fp8_dir, device="cpu", progress=False, weights="dequantize")
    for seed, n in ((0, 23), (1, 64)):
        ids = _ids(FP8_V3["vocab_size"], n, seed)
        with torch.no_grad():
            want = oracle(ids[None]).logits[0]
        got = _logits(model, ids)
        assert _rel(got, want) <= 1e-4
        assert _rel(_logits(deq, ids), want) <= 1e-4


def test_fp8_mtp_layer_equals_the_dequantised_model(dirs):
    """The MTP layer's fp8 weights load: its forward equals the same layer loaded from the dequantised directory."""
    fp8_dir, deq_dir = dirs
    a = load_model(fp8_dir, device="cpu", progress=False)
    b = load_model(deq_dir, device="cpu", progress=False)
    ids = _ids(FP8_V3["vocab_size"], 17, 2)
    meta = AttentionMetadata.for_contiguous([17])
    with torch.no_grad():
        ha, hb = a(ids, meta), b(ids, meta)
        ma = a.mtp_logits(0, a.mtp_forward(0, ids.roll(-1), ha, meta))
        mb = b.mtp_logits(0, b.mtp_forward(0, ids.roll(-1), hb, meta))
    assert _rel(ma, mb) <= 1e-5


def test_fp8_greedy_mtp_speculation_equals_plain(dirs):
    from specmla import LLM, SamplingParams

    fp8_dir, _ = dirs
    prompts = [_ids(FP8_V3["vocab_size"], n, s).tolist() for s, n in ((3, 9), (4, 30), (5, 1))]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = LLM(fp8_dir, device="cpu", num_pages=64, page_size=16).generate(prompts, sp)
    spec = LLM(fp8_dir, device="cpu", num_pages=64, page_size=16, speculative="mtp",
               num_speculative_tokens=2).generate(prompts, sp)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


@pytest.mark.parametrize("change,match", [
    ({"quant_method": "awq"}, "awq"),
    ({"weight_block_size": [64, 64]}, "64"),
    ({"fmt": "e5m2"}, "e5m2"),
    ({"activation_scheme": "static"}, "static"),
])
def test_other_quantisation_configs_are_refused(dirs, tmp_path, change, match):
    fp8_dir, _ = dirs
    dst = tmp_path / "ckpt"
    shutil.copytree(fp8_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=match):
        load_model(dst, device="cpu", progress=False)


def test_float8_weight_without_its_scale_is_named(dirs, tmp_path):
    fp8_dir, _ = dirs
    dst = tmp_path / "ckpt"
    dst.mkdir()
    tensors = read_checkpoint(fp8_dir)
    victim = "model.layers.2.self_attn.kv_b_proj.weight"  # dequantised at load: needs its scale
    del tensors[victim + "_scale_inv"]
    save_tensors(tensors, dst, 200_000)
    for f in fp8_dir.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    with pytest.raises(CheckpointError, match="kv_b_proj.weight_scale_inv"):
        load_model(dst, device="cpu", progress=False)


def test_in_memory_quantisation_equals_loading_the_fp8_directory(dirs):
    """`quantize_fp8_` on the model loaded from the unquantised source gives the FP8 directory's model byte for
    byte: the same layers quantised, the same padding and block scales."""
    from specmla.model.fp8 import quantize_fp8_

    fp8_dir, _ = dirs
    src = fp8_dir.parent / "src"
    quantised = quantize_fp8_(load_model(src, device="cpu", progress=False), chunk=3)
    loaded = load_model(fp8_dir, device="cpu", progress=False)
    a, b = dict(quantised.named_parameters()), dict(loaded.named_parameters())
    assert a.keys() == b.keys()
    for name, p in a.items():
        q = b[name]
        assert p.dtype == q.dtype and p.shape == q.shape, name
        if name.endswith("kv_b_proj.weight"):  # the loader dequantises it; quantize_fp8_ leaves it unquantised
            continue
        same = torch.equal(p.view(torch.uint8), q.view(torch.uint8)) if p.dtype == torch.float8_e4m3fn else \
            torch.equal(p, q)
        assert same, name


def test_fp8_numerics_option_is_validated_and_reaches_every_fp8_layer(dirs):
    """fp8_numerics: a value other than "auto" / "emulate" is refused by LLM and load_model, "emulate" on a model
    without FP8 layers too; "emulate" sets every Fp8Linear and float8 MoE to the "w8a8_torch" backend, and the
    logits then leave the dequantised reference's by about the activations' e4m3 rounding."""
    from specmla import LLM
    from specmla.model.fp8 import fp8_numerics_of

    fp8_dir, deq_dir = dirs
    with pytest.raises(ValueError, match="fp8_numerics='bogus'"):
        LLM(fp8_dir, device="cpu", fp8_numerics="bogus")
    with pytest.raises(ValueError, match="fp8_numerics='w8a8'"):
        load_model(fp8_dir, device="cpu", progress=False, fp8_numerics="w8a8")
    with pytest.raises(ValueError, match="needs FP8 layers"):
        load_model(fp8_dir, device="cpu", progress=False, weights="dequantize", fp8_numerics="emulate")
    with pytest.raises(ValueError, match="needs FP8 layers"):
        LLM(deq_dir, device="cpu", fp8_numerics="emulate")
    exact = load_model(fp8_dir, device="cpu", progress=False)
    emulated = load_model(fp8_dir, device="cpu", progress=False, fp8_numerics="emulate")
    assert fp8_numerics_of(exact) == "auto" and fp8_numerics_of(emulated) == "emulate"
    layers = [m for m in emulated.modules() if isinstance(m, Fp8Linear) or isinstance(m, MoE)]
    assert len(layers) > 10 and {m.backend for m in layers} == {"w8a8_torch"}
    assert {m.backend for m in exact.modules() if isinstance(m, (Fp8Linear, MoE))} == {"auto"}
    ids = _ids(FP8_V3["vocab_size"], 23, 0)
    rel = _rel(_logits(emulated, ids), _logits(exact, ids))
    assert 1e-3 <= rel <= 0.35  # see test_gpu_fp8_model_w8a8_logits_and_greedy_tokens for the random model's gain


def test_embedded_fp8_model_runs_the_emulation_through_llm(embedded_fp8_dir, monkeypatch):
    """CPU, the embedded model in FP8 with LLM(fp8_numerics="emulate"): every FP8 product of the engine's steps
    (the fused input projections included) runs the w8a8 emulation, none the dequantised reference, and the greedy
    tokens (2 prompts × 6) equal a step-by-step greedy decode of the same model's cache-free forward."""
    import specmla.ops.linear as linear_ops
    import specmla.ops.moe as moe_ops
    from specmla import LLM, SamplingParams

    calls = {"w8a8": 0, "exact": 0, "moe_act_quant": 0, "moe_exact": 0}

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    def counted_moe(*args, act_quant=False, **kwargs):
        calls["moe_act_quant" if act_quant else "moe_exact"] += 1
        return fused_moe_torch(*args, act_quant=act_quant, **kwargs)

    from specmla.ops.moe.reference import fused_moe_torch
    monkeypatch.setattr(linear_ops, "fp8_block_linear_w8a8_torch",
                        counted(linear_ops.fp8_block_linear_w8a8_torch, "w8a8"))
    monkeypatch.setattr(linear_ops, "fp8_block_linear_torch", counted(linear_ops.fp8_block_linear_torch, "exact"))
    monkeypatch.setattr(moe_ops, "fused_moe_torch", counted_moe)
    llm = LLM(embedded_fp8_dir, device="cpu", num_pages=32, page_size=16, fp8_numerics="emulate")
    assert llm.model.model.layers[0].self_attn.input_proj_weight.dtype == torch.float8_e4m3fn  # fused
    prompts = _code_prompts(llm.tokenizer, 2)
    got = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert calls["w8a8"] > 0 and calls["moe_act_quant"] > 0 and calls["exact"] == calls["moe_exact"] == 0
    model = load_model(embedded_fp8_dir, device="cpu", progress=False, fp8_numerics="emulate")
    for prompt, out in zip(prompts, got):
        ids = torch.tensor(prompt)
        for _ in range(6):
            ids = torch.cat([ids, _logits(model, ids)[-1].argmax().view(1)])
        assert out.token_ids == ids[len(prompt):].tolist()


@pytest.mark.gpu
def test_gpu_fp8_model_w8a8_logits_and_greedy_tokens(dirs):
    """On the GPU the FP8 layers run the w8a8 kernels (activations rounded to e4m3 per token and 128 columns: 3
    mantissa bits, about 2.4 % rms per element, so about 2.5 % per linear layer and 4.4 % per MoE layer, which
    rounds x and h). Each FP8 linear layer of the model on its own is within 3e-2 of the reference (the weights
    dequantised, fp32). The whole model's logits: this random model amplifies per-layer perturbations (its bf16
    path, 0.2–0.4 % per op, ends 2 % off), and the w8a8 path measured 0.20 / 0.28 (23 / 200 tokens) on an H100;
    bounded at 0.35 here. The greedy continuations are printed as the fraction equal to the reference's (first
    token and all 32)."""
    from specmla import LLM, SamplingParams

    fp8_dir, _ = dirs
    gpu = load_model(fp8_dir, device="cuda", progress=False)  # bf16 activations
    cpu = load_model(fp8_dir, device="cpu", progress=False)
    g = torch.Generator().manual_seed(7)
    for name, module in cpu.named_modules():
        if isinstance(module, Fp8Linear):
            x = torch.randn(37, module.in_features, generator=g)
            with torch.no_grad():
                assert _rel(gpu.get_submodule(name)(x.cuda().bfloat16()).cpu(), module(x)) <= 3e-2, name
    for seed, n in ((0, 23), (1, 200)):
        ids = _ids(FP8_V3["vocab_size"], n, seed)
        rel = _rel(_logits(gpu, ids.cuda()).cpu(), _logits(cpu, ids))
        print(f"w8a8 GPU logits against the reference, {n} tokens: rel {rel:.2e}")
        assert rel <= 0.35
    del gpu
    prompts = [_ids(FP8_V3["vocab_size"], n, 10 + s).tolist() for s, n in enumerate((5, 17, 40, 64, 9, 100, 33, 21))]
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    got = LLM(fp8_dir, device="cuda", num_pages=128, page_size=16).generate(prompts, sp)
    want = LLM(fp8_dir, device="cpu", num_pages=128, page_size=16).generate(prompts, sp)
    first = sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(got, want)) / len(prompts)
    whole = sum(a.token_ids == b.token_ids for a, b in zip(got, want)) / len(prompts)
    print(f"greedy continuations equal to the reference: first token {first:.0%}, all 32 tokens {whole:.0%} of "
          f"{len(prompts)} prompts")
    assert first >= 0.5


@pytest.mark.gpu
def test_gpu_fp8_greedy_mtp_speculation_equals_plain(dirs):
    """fp32 activations (no bf16 tile-shape rounding differences) over the FP8 weights, CUDA graphs on: greedy MTP
    speculation (k = 3) gives plain greedy decoding's tokens."""
    from specmla import LLM, SamplingParams

    fp8_dir, _ = dirs
    prompts = [_ids(FP8_V3["vocab_size"], n, 20 + s).tolist() for s, n in enumerate((7, 30, 64, 12))]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(fp8_dir, device="cuda", dtype="float32", num_pages=128, page_size=16).generate(prompts, sp)
    spec = LLM(fp8_dir, device="cuda", dtype="float32", num_pages=128, page_size=16, speculative="mtp",
               num_speculative_tokens=3).generate(prompts, sp)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


@pytest.mark.gpu
def test_gpu_fp8_embedded_model_greedy_agreement(embedded_fp8_dir):
    """The trained embedded model quantised as DeepSeek's FP8 checkpoints are: greedy 32-token continuations of
    code prompts on the GPU's w8a8 path (bf16 activations) against the same FP8 directory on the CPU reference (fp32,
    weights dequantised, activations exact): what w8a8 costs against exact activations. Measured on an H100: all 32
    tokens equal on 42 % of 12 prompts, 67 % of tokens at equal positions; printed, and bounded at a third of the
    prompts here. (`test_gpu_fp8_embedded_model_kernels_match_the_w8a8_emulation` holds the kernels to DeepSeek's
    w8a8 numerics themselves.)"""
    from specmla import LLM, SamplingParams

    cpu = LLM(embedded_fp8_dir, device="cpu", num_pages=256, page_size=16)
    prompts = _code_prompts(cpu.tokenizer, 12)
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want = cpu.generate(prompts, sp)
    got = LLM(embedded_fp8_dir, device="cuda", num_pages=256, page_size=16).generate(prompts, sp)
    whole = sum(a.token_ids == b.token_ids for a, b in zip(got, want)) / len(prompts)
    tokens = sum(x == y for a, b in zip(got, want) for x, y in zip(a.token_ids, b.token_ids)) / (32 * len(prompts))
    print(f"embedded model, FP8 w8a8 on the GPU: all 32 greedy tokens equal on {whole:.0%} of {len(prompts)} prompts, "
          f"{tokens:.0%} of tokens at equal positions")
    assert whole >= 1 / 3


TIE_NATS = 0.5  # a greedy choice within this of the best logit is a near-tie (4 bf16 steps of logits of 16–32)


@pytest.mark.gpu
def test_gpu_fp8_embedded_model_kernels_match_the_w8a8_emulation(embedded_fp8_dir):
    """The bar of DeepSeek's w8a8 numerics on the trained embedded model in FP8, bf16 activations. Per layer: every
    Fp8Linear and every MoE layer's fused experts on the kernels (backend "auto" on CUDA) within 1e-2 (Frobenius) of
    the torch emulation ("w8a8_torch": act_quant per token per 128 columns, block-scaled weights, fp32 products) on
    random rows (measured on an H200: linear layers 1.7e-3, the bf16 output's rounding; MoE layers 5e-5).

    Whole model: `LLM(fp8_dir, device="cuda")` (kernels, CUDA graphs) against `LLM(fp8_dir, device="cuda",
    fp8_numerics="emulate")` (eager; everything but the FP8 layers runs the same kernels), 12 code prompts × 32
    greedy tokens. Whole continuations equal are printed, not bounded: two correct w8a8 computations of this model
    part at near-ties. Re-rounding a bf16 activation one ulp apart moves an e4m3 code by a whole step (8 % of the
    value) where it sits on a rounding boundary, so sums in another order end the 4 layers about 2 % apart in the
    logits, and bf16 logits tie exactly at 1 % of greedy positions (H200: 67 % of prompts equal whole, 75 % with fp32
    activations; the kernels' own cache-free forward picks another token than their engine run on 6 of 12
    prompts). Bounded: at least 95 % of the prompts equal whole or part at a near-tie, the kernels' token within
    `TIE_NATS` of the emulation's best there (its logprobs)."""
    from specmla import LLM, SamplingParams
    from specmla.ops import fused_moe

    model = load_model(embedded_fp8_dir, device="cuda", progress=False)
    g = torch.Generator(device="cuda").manual_seed(3)
    checked = 0
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, Fp8Linear):
                x = torch.randn(37, m.in_features, generator=g, device="cuda").bfloat16()
                got = fp8_block_linear(x, m.weight, m.weight_scale_inv, bias=m.bias)
                want = fp8_block_linear(x, m.weight, m.weight_scale_inv, bias=m.bias, backend="w8a8_torch",
                                        out_dtype=torch.float32)
            elif isinstance(m, MoE) and m.w_gate_up_scale is not None:
                x = torch.randn(37, m.w_down.shape[1], generator=g, device="cuda").bfloat16()
                weights, ids = m.gate(x)
                shared = m.shared_down is not None
                kw = dict(w_gate_up_scale=m.w_gate_up_scale, w_down_scale=m.w_down_scale,
                          shared=(m.shared_gate_up, m.shared_down) if shared else None,
                          shared_scales=(m.shared_gate_up_scale, m.shared_down_scale) if shared else None)
                got = fused_moe(x, m.w_gate_up, m.w_down, weights, ids, **kw)
                want = fused_moe(x, m.w_gate_up, m.w_down, weights, ids, **kw, backend="w8a8_torch")
            else:
                continue
            rel = _rel(got, want)
            print(f"{name}: kernels against the w8a8 emulation, rel {rel:.1e}")
            assert rel <= 1e-2, name
            checked += 1
    assert checked > 10
    del model
    llm = LLM(embedded_fp8_dir, device="cuda", num_pages=256, page_size=16)
    prompts = _code_prompts(llm.tokenizer, 12)
    got = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    del llm
    emulated = LLM(embedded_fp8_dir, device="cuda", num_pages=256, page_size=16, fp8_numerics="emulate")
    want = emulated.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=8))
    whole = tied = 0
    for a, b in zip(got, want):
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if first is None:
            whole += 1
            continue
        top = b.logprobs[first]["top"]
        gap = top[b.token_ids[first]] - top.get(a.token_ids[first], -float("inf"))
        print(f"parted at token {first}: the kernels' token {gap:.3f} nats below the emulation's best")
        tied += gap <= TIE_NATS
    tokens = sum(x == y for a, b in zip(got, want) for x, y in zip(a.token_ids, b.token_ids)) / (32 * len(prompts))
    print(f"embedded model in FP8, kernels against the w8a8 emulation: all 32 greedy tokens equal on "
          f"{whole / len(prompts):.0%} of {len(prompts)} prompts, parted at a near-tie on {tied}, {tokens:.0%} of "
          f"tokens at equal positions")
    assert (whole + tied) / len(prompts) >= 0.95
