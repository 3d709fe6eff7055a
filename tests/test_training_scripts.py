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

ROOT = Path(__file__).resolve().parent.parent


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


def test_trained_directory_loads_in_specmla_and_transformers(pipeline):
    from transformers import DeepseekV3ForCausalLM

    from specmla import LLM, SamplingParams
    from specmla.model.metadata import AttentionMetadata

    _, model_dir = pipeline
    card = (model_dir / "MODEL_CARD.md").read_text()
    assert "perplexity" in card and "MTP top-1 acceptance" in card
    llm = LLM(model_dir, device="cpu", dtype="float32")
    assert len(llm.model.mtp) == 1  # the MTP layer was saved and loaded
    out = llm.generate("def f(x):", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5
    hf = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([llm.tokenizer.encode("import os\nprint(os.getcwd())")])
    with torch.no_grad():
        want = hf(ids).logits[0]
        got = llm.model.compute_logits(llm.model(ids[0], AttentionMetadata.for_contiguous([ids.shape[1]])))
    assert ((got - want).norm() / want.norm()).item() <= 1e-4
