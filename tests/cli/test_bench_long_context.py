"""bench_long_context's CPU side: the YaRN-stretched copy of the embedded model loads and generates past its
trained length, the prompt comes from the standard library, and a run reports the cache's real row bytes."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_long_context as bl  # noqa: E402

from specmla.model.default import default_model_path  # noqa: E402


def test_stretched_model_reaches_the_context_by_yarn(tmp_path):
    src = Path(default_model_path())
    path = bl.stretched_model(src, tmp_path / "m", 3 * bl.TRAINED_POSITIONS)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 3 * bl.TRAINED_POSITIONS
    assert cfg["rope_scaling"]["type"] == "yarn" and cfg["rope_scaling"]["factor"] == 3.0
    assert cfg["rope_scaling"]["original_max_position_embeddings"] == bl.TRAINED_POSITIONS
    assert (path / "model.safetensors").is_symlink() and (path / "model.safetensors").resolve() == \
        (src / "model.safetensors").resolve()
    plain = json.loads((src / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k not in ("rope_scaling", "max_position_embeddings")} == \
        {k: v for k, v in plain.items() if k not in ("rope_scaling", "max_position_embeddings")}
    short = bl.stretched_model(src, tmp_path / "s", 1000)  # never below the trained length
    assert json.loads((short / "config.json").read_text())["rope_scaling"]["factor"] == 1.0


def test_a_run_past_the_trained_length_reports_row_bytes(tmp_path):
    context = bl.TRAINED_POSITIONS + 200
    path = bl.stretched_model(Path(default_model_path()), tmp_path / "m", context)
    rows = {kv: bl.run(path, kv, "mtp", 2, context, 6, "cpu", "float32") for kv in ("bf16", "tbq4")}
    layers = 5  # the embedded model's 4 layers and its MTP layer
    assert rows["bf16"]["kv_bytes_per_token"] == layers * 1152 and rows["tbq4"]["kv_bytes_per_token"] == layers * 400
    for row in rows.values():
        assert row["new_tokens"] == 6 and row["decode_tok_s"] > 0 and row["ttft_s"] > 0
        assert 1.0 <= row["acceptance_length"] <= 3.0
        assert row["kv_bytes"] == row["kv_bytes_per_token"] * (context + 6)
