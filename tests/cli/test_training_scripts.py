"""The embedded model's pipeline end to end on CPU: data split + tokenizer, a few training steps,
an HF-format directory that specmla and transformers both load with equal logits."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    data, model = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("model")
    run("scripts/prepare_data.py", "--out", str(data), "--limit-files", "60", "--vocab-size", "600",
        "--heldout-frac", "0.1")
    run("scripts/train_tiny.py", "--data", str(data), "--out", str(model), "--smoke")
    return data, model


def test_data_split_is_by_file_disjoint_and_reproducible(pipeline, tmp_path):
    data, _ = pipeline
    train = (data / "files_train.txt").read_text().splitlines()[1:]
    held = (data / "files_heldout.txt").read_text().splitlines()[1:]
    assert train and held and not set(train) & set(held)
    stats = json.loads((data / "stats.json").read_text())
    assert stats["train"]["tokens"] == np.fromfile(data / "train.bin", dtype=np.uint16).size
    assert stats["vocab_size"] == 600
    run("scripts/prepare_data.py", "--out", str(tmp_path), "--limit-files", "60", "--vocab-size", "600",
        "--heldout-frac", "0.1")
    assert (tmp_path / "files_heldout.txt").read_text() == (data / "files_heldout.txt").read_text()
    assert (tmp_path / "train.bin").read_bytes() == (data / "train.bin").read_bytes()


def logits_vs_transformers(llm, model_dir, text):
    """(specmla's, transformers') fp32 logits for `text` on the same directory."""
    from transformers import DeepseekV3ForCausalLM

    from specmla.model.metadata import AttentionMetadata

    hf = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([llm.tokenizer.encode(text)])
    with torch.no_grad():
        want = hf(ids).logits[0]
        got = llm.model.compute_logits(llm.model(ids[0], AttentionMetadata.for_contiguous([ids.shape[1]])))
    return got, want


def test_trained_directory_loads_in_specmla_and_transformers(pipeline):
    from specmla import LLM, SamplingParams

    _, model_dir = pipeline
    card = (model_dir / "MODEL_CARD.md").read_text()
    assert "perplexity" in card and "MTP top-1 acceptance" in card
    llm = LLM(model_dir, device="cpu", dtype="float32")
    assert len(llm.model.mtp) == 1  # the MTP layer was saved and loaded
    out = llm.generate("def f(x):", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5
    got, want = logits_vs_transformers(llm, model_dir, "import os\nprint(os.getcwd())")
    assert ((got - want).norm() / want.norm()).item() <= 1e-4


def test_shipped_model_matches_transformers_and_card():
    """The embedded model in specmla/assets: transformers loads it (MTP layer ignored) with the same
    logits as specmla, and its card carries the held-out figures."""
    from specmla import LLM
    from specmla.model.default import ASSETS

    card = (ASSETS / "MODEL_CARD.md").read_text()
    assert "perplexity" in card and "MTP top-1 acceptance" in card
    total = sum(f.stat().st_size for f in ASSETS.iterdir())
    assert total <= 40e6, f"assets are {total / 1e6:.1f} MB"
    llm = LLM(ASSETS, device="cpu", dtype="float32")
    assert len(llm.model.mtp) == 1
    got, want = logits_vs_transformers(llm, ASSETS, "def fibonacci(n):\n    if n < 2:\n        return n\n")
    assert ((got - want).norm() / want.norm()).item() <= 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.99


def test_training_attention_path_equals_reference_forward_and_grad():
    """Training batches (equal lengths, grad on) take one batched causal SDPA; it must give the
    reference loop's outputs and gradients."""
    from specmla.config import ModelConfig
    from specmla.model.deepseek import DeepseekForCausalLM
    from specmla.model.default import TINY_RANDOM_CONFIG
    from specmla.model.metadata import AttentionMetadata

    cfg = ModelConfig.from_dict(dict(TINY_RANDOM_CONFIG, hidden_size=64, kv_lora_rank=32, qk_nope_head_dim=16,
                                     qk_rope_head_dim=16, v_head_dim=24, intermediate_size=96,
                                     moe_intermediate_size=32))
    torch.manual_seed(0)
    model = DeepseekForCausalLM(cfg, max_positions=64)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 if p.dim() > 1 else 1 + 0.1 * torch.randn_like(p))
    tokens = torch.randint(0, cfg.vocab_size, (3, 13))
    meta = AttentionMetadata.for_contiguous([13] * 3)
    assert meta.uniform_len == 13 and AttentionMetadata.for_contiguous([13, 12]).uniform_len == 0

    def loss_and_grads(batched: bool):
        model.zero_grad()
        m = meta if batched else AttentionMetadata.for_contiguous([13] * 3)
        if not batched:
            m.uniform_len = 0  # force the per-request reference
        loss = model.compute_logits(model(tokens.reshape(-1), m)).logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    l1, g1 = loss_and_grads(True)
    l0, g0 = loss_and_grads(False)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert g1.keys() == g0.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_distill_mtp_changes_only_the_mtp_module(pipeline, tmp_path):
    """scripts/distill_mtp.py: the trunk's tensors come out bit for bit the same, the run is recorded in
    training.json and the card, and the kept MTP weights are no worse on held-out acceptance."""
    from safetensors.torch import load_file

    data, model_dir = pipeline
    out = tmp_path / "distilled"
    run("scripts/distill_mtp.py", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--smoke",
        "--lr", "0.01")
    before, after = load_file(model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    n = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    mtp = [k for k in before if k.startswith(f"model.layers.{n}.")]
    assert mtp and len(mtp) < len(before)
    for k in before:
        if k not in mtp:
            assert torch.equal(before[k], after[k]), k
    record = json.loads((out / "training.json").read_text())["mtp_distillation"]
    assert record["result"]["steps"] == 3 and record["args"]["recursive_weight"] == 0.5
    assert record["result"]["after"]["mtp_acceptance"] >= record["result"]["before"]["mtp_acceptance"]
    assert record["result"]["after"]["heldout_ppl"] == record["result"]["before"]["heldout_ppl"]
    assert "MTP self-distillation" in (out / "MODEL_CARD.md").read_text()
    assert (out / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


def test_distill_loss_scores_each_draft_step_against_the_right_trunk_position():
    """distill_loss's terms, against a per-request loop written out position by position: step 1's row i
    (trunk state i, token i+1) against the trunk's distribution at i+1; step j's row i (step j-1's state
    i, token i+j) against the trunk at i+j, for j = 2, 3."""
    import importlib
    import sys

    from specmla.config import ModelConfig
    from specmla.model.deepseek import DeepseekForCausalLM
    from specmla.model.default import TINY_RANDOM_CONFIG
    from specmla.model.metadata import AttentionMetadata

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        distill_loss = importlib.import_module("distill_mtp").distill_loss
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    cfg = ModelConfig.from_dict(dict(TINY_RANDOM_CONFIG, hidden_size=64, kv_lora_rank=32, qk_nope_head_dim=16,
                                     qk_rope_head_dim=16, v_head_dim=24, intermediate_size=96,
                                     moe_intermediate_size=32, num_nextn_predict_layers=1))
    torch.manual_seed(1)
    model = DeepseekForCausalLM(cfg, max_positions=64)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 if p.dim() > 1 else 1 + 0.1 * torch.randn_like(p))
    B, L = 3, 11
    tokens = torch.randint(0, cfg.vocab_size, (B, L + 1))
    with torch.no_grad():
        first, _ = distill_loss(model, tokens, 0.0)
        both, _ = distill_loss(model, tokens, 2.0)
        three, _ = distill_loss(model, tokens, 2.0, recursive_steps=2)

    def kl(t, s):  # KL(teacher ‖ student) of one row, from log-probabilities
        return (t.exp() * (t - s)).sum().item()

    ref1, ref2, ref3 = [], [], []
    with torch.no_grad():
        for b in range(B):
            t = tokens[b]
            hidden = model(t[:L], AttentionMetadata.for_contiguous([L]))
            trunk = model.compute_logits(hidden).log_softmax(-1)  # trunk[j]: the token after position j
            h1 = model.mtp_forward(0, t[1 : L + 1], hidden, AttentionMetadata.for_contiguous([L]))
            s1 = model.mtp_logits(0, h1).log_softmax(-1)
            h2 = model.mtp_forward(0, t[2 : L + 1], h1[: L - 1], AttentionMetadata.for_contiguous([L - 1]))
            s2 = model.mtp_logits(0, h2).log_softmax(-1)
            ref1 += [kl(trunk[i + 1], s1[i]) for i in range(L - 1)]
            ref2 += [kl(trunk[i + 2], s2[i]) for i in range(L - 2)]
            h3 = model.mtp_forward(0, t[3 : L + 1], h2[: L - 2], AttentionMetadata.for_contiguous([L - 2]))
            s3 = model.mtp_logits(0, h3).log_softmax(-1)
            ref3 += [kl(trunk[i + 3], s3[i]) for i in range(L - 3)]
    want1 = sum(ref1) / len(ref1)
    want2 = sum(ref2) / len(ref2)
    want3 = sum(ref3) / len(ref3)
    assert want1 > 0.01 and want2 > 0.01 and want3 > 0.01
    assert abs(first.item() - want1) <= 1e-4 * want1
    assert abs((both - first).item() / 2.0 - want2) <= 1e-4 * want2
    assert abs((three - both).item() / 2.0 - want3) <= 1e-4 * want3
