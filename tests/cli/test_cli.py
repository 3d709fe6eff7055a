import json
import os
import subprocess
import sys


def run_cli(*args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "specmla.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_generate_streams_text_and_reports_speed(tiny_model_dir):
    r = run_cli("generate", "--model", str(tiny_model_dir), "--prompt", "def fibonacci(n):", "--max-tokens", "8",
                "--device", "cpu", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def fibonacci(n):")
    assert "tokens/s" in r.stderr and "8 tokens" in r.stderr


def test_generate_default_model_builds_on_first_run(tmp_path):
    from specmla.model.default import ASSETS

    r = run_cli("generate", "--prompt", "hi", "--max-tokens", "3", "--device", "cpu", "--ignore-eos",
                env_extra={"SPECMLA_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    if (ASSETS / "config.json").exists():  # the trained embedded model is the default once it ships
        assert str(ASSETS) in r.stderr
    else:
        assert (tmp_path / "tiny-random-v1" / "model.safetensors").exists()


def test_generate_bad_model_path_is_a_clear_error(tmp_path):
    r = run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "x", "--device", "cpu")
    assert r.returncode == 2
    assert r.stderr.strip() == f"specmla: error: model directory {tmp_path / 'nope'} does not exist"


def test_bench_throughput_reports_vllm_metrics(tiny_model_dir, tmp_path):
    out = tmp_path / "r.json"
    r = run_cli("bench", "throughput", "--model", str(tiny_model_dir), "--num-prompts", "5", "--input-len", "20",
                "--output-len", "6", "--device", "cpu", "--max-num-batched-tokens", "32", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "output throughput" in r.stdout and "TTFT" in r.stdout and "TPOT" in r.stdout
    import json

    res = json.loads(out.read_text())["specmla"]
    assert res["requests"] == 5 and res["output_tokens"] == 30 and res["input_tokens"] == 100
    assert res["output_tok_per_s"] > 0 and res["ttft_s"]["median"] > 0 and res["tpot_s"]["median"] > 0


def test_bench_prompts_from_file(tmp_path):
    from specmla.bench import load_prompts

    f = tmp_path / "p.txt"
    f.write_text('def f(x):\n{"prompt": "import os"}\n\n')
    assert load_prompts(str(f), 3, 0, 100, 0) == ["def f(x):", "import os", "def f(x):"]
    rand = load_prompts(None, 2, 7, 50, 1)
    assert len(rand) == 2 and all(len(p) == 7 and max(p) < 50 for p in rand)
    (tmp_path / "empty.txt").write_text("\n")
    import pytest

    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(str(tmp_path / "empty.txt"), 1, 0, 10, 0)


def test_generate_with_ngram_speculation_reports_acceptance(tiny_model_dir):
    r = run_cli("generate", "--model", str(tiny_model_dir), "--prompt", "abcabcabcabcabc", "--max-tokens", "12",
                "--device", "cpu", "--ignore-eos", "--speculative", "ngram", "--num-speculative-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert "speculative ngram" in r.stderr and "mean acceptance length" in r.stderr


def test_bench_spec_sweep_keeps_outputs_identical(tiny_model_dir, tmp_path):
    out = tmp_path / "spec.json"
    r = run_cli("bench", "spec", "--model", str(tiny_model_dir), "--device", "cpu", "--batch", "3", "--k", "2",
                "--modes", "none", "ngram", "mtp", "--input-len", "24", "--output-len", "8", "--json", str(out))
    assert r.returncode == 0, r.stderr
    import json

    rows = json.loads(out.read_text())
    assert [(x["mode"], x["k"]) for x in rows] == [("none", 0), ("ngram", 2), ("mtp", 2)]
    assert all(x["same_output"] for x in rows)  # greedy speculation is lossless
    assert "accepted per position" in r.stdout


def test_torchrun_ranks_generate_what_one_process_generates(tiny_model_dir):
    """The multi-node launch path on one host: torchrun starts 2 ranks (env:// rendezvous); rank 0 runs the command,
    rank 1 builds the same engine (here with n-gram speculation) and follows it; both exit when it is done."""
    args = ["generate", "--model", str(tiny_model_dir), "--device", "cpu", "--num-pages", "256", "--prompt",
            "hello there", "--max-tokens", "12", "--ignore-eos", "--speculative", "ngram"]
    one = run_cli(*args)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "specmla.cli", *args, "--tp", "2"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout and one.stdout.startswith("hello there")


def test_generate_with_dummy_weights_needs_config_and_tokenizer_only(tiny_model_dir, tmp_path):
    """--load-format dummy: a directory without weights generates (MTP drafts too: config.json declares the layer);
    without the flag the same directory is refused before any load."""
    import shutil

    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    args = ("generate", "--model", str(tmp_path), "--prompt", "abc", "--max-tokens", "4", "--device", "cpu",
            "--ignore-eos")
    r = run_cli(*args, "--load-format", "dummy", "--speculative", "mtp", "--num-speculative-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("abc") and "4 tokens" in r.stderr
    r = run_cli(*args)
    assert r.returncode == 2 and "neither model.safetensors nor" in r.stderr


def test_serve_batches_for_its_device_unless_told(monkeypatch):
    """`serve` without --max-num-seqs / --max-num-batched-tokens batches as a large GPU's server on a GPU and keeps
    the offline defaults on the CPU; given values stay; other commands keep theirs."""
    from specmla import cli
    from specmla.engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS

    def resolved(argv, gpu):
        monkeypatch.setattr(cli, "_cuda_available", lambda: gpu)
        args = cli.build_parser().parse_args(argv)
        cli.resolve_serve_batching(args)
        return args.max_num_seqs, args.max_num_batched_tokens

    gpu_defaults = (cli.SERVE_GPU_MAX_NUM_SEQS, cli.SERVE_GPU_MAX_NUM_BATCHED_TOKENS)
    assert resolved(["serve"], gpu=True) == gpu_defaults
    assert resolved(["serve"], gpu=False) == (64, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    assert resolved(["serve", "--device", "cpu"], gpu=True) == (64, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    assert resolved(["serve", "--max-num-seqs", "7"], gpu=True) == (7, gpu_defaults[1])
    assert resolved(["serve", "--max-num-batched-tokens", "100"], gpu=False) == (64, 100)
    assert resolved(["bench", "throughput"], gpu=True) == (64, DEFAULT_MAX_NUM_BATCHED_TOKENS)


def test_tune_check_lists_the_shapes_that_run_untuned(tmp_path):
    """`specmla tune --check` for a named GPU: with no tables the model's decode keys and MoE shapes all run on the
    rules; a user's table covering them moves them to measured. Without --check it measures, which needs a GPU."""
    from specmla.ops import tuned

    model = tmp_path / "model"
    model.mkdir()
    cfg = {"model_type": "deepseek_v2", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
           "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "kv_lora_rank": 64,
           "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "first_k_dense_replace": 1}
    (model / "config.json").write_text(json.dumps(cfg))
    env = {"SPECMLA_TUNED": str(tmp_path / "tuned"), "SPECMLA_TUNING": "auto"}
    args = ("tune", "--check", "--device-name", "Fake GPU-9", "--model", str(model), "--kv-formats", "bf16,fp8",
            "--num-speculative-tokens", "3")
    r = run_cli(*args, env_extra=env)
    assert r.returncode == 0, r.stderr
    assert "decode_routes: rules" in r.stdout and "moe: rules" in r.stdout
    assert "bf16,1,4, bf16,4,4, fp8,1,4, fp8,4,4" in r.stdout and "up,8,32,64, down,8,64,32" in r.stdout
    assert "6 shape(s) run on the rules" in r.stdout
    folder = tmp_path / "tuned"
    tuned.write("moe", "Fake_GPU_9", {"up,8,32,64": [[8, {"block_m": 16, "block_n": 32, "block_k": 32}]],
                                      "down,8,64,32": [[8, {"block_m": 16, "block_n": 32, "block_k": 32}]]},
                folder=folder / "moe")
    r = run_cli(*args, env_extra=env)
    assert "measured: up,8,32,64, down,8,64,32" in r.stdout and "4 shape(s) run on the rules" in r.stdout
    r = run_cli("tune", "--model", str(model), env_extra=env)  # measuring needs the GPU
    assert r.returncode == 2 and "CUDA GPU" in r.stderr


def test_tune_check_lists_an_fp8_checkpoints_linear_shapes(tmp_path):
    """For a checkpoint with FP8 weights the check also lists the FP8 linear's weight shapes (kv_b_proj, dequantised
    at load, and the head are not among them); a user's "fp8_linear" table covering one moves it to measured."""
    from specmla.config import FP8_QUANTIZATION
    from specmla.ops import tuned

    model = tmp_path / "model"
    model.mkdir()
    cfg = {"model_type": "deepseek_v3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
           "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "kv_lora_rank": 32,
           "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
           "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
           "quantization_config": FP8_QUANTIZATION}
    (model / "config.json").write_text(json.dumps(cfg))
    env = {"SPECMLA_TUNED": str(tmp_path / "tuned"), "SPECMLA_TUNING": "auto"}
    args = ("tune", "--check", "--device-name", "Fake GPU-9", "--model", str(model))
    r = run_cli(*args, env_extra=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "fp8_linear: rules" in lines
    untuned = lines[lines.index("fp8_linear: rules") + 1]
    assert untuned.startswith("  untuned (rules): ")  # q_a and kv_a share 48 x 64: one shape
    assert set(untuned.split(": ", 1)[1].split(", ")) == {"48,64", "128,48", "64,64", "96,64", "64,96"}
    tuned.write("fp8_linear", "Fake_GPU_9", {"96,64": [[1, {"split": 1, "BLOCK_N": 32, "num_warps": 4,
                                                            "num_stages": 3}]]}, folder=tmp_path / "tuned" / "fp8_linear")
    r = run_cli(*args, env_extra=env)
    assert "measured: 96,64" in r.stdout
    by_config = run_cli("tune", "--check", "--device-name", "Fake GPU-9", "--config", str(model / "config.json"),
                        env_extra=env)  # the config alone, no weights: the same shapes
    assert by_config.returncode == 0 and by_config.stdout == r.stdout
    both = run_cli("tune", "--check", "--model", str(model), "--config", str(model / "config.json"), env_extra=env)
    assert both.returncode == 2 and "not allowed with" in both.stderr
    missing = run_cli("tune", "--check", "--config", str(model / "nope.json"), env_extra=env)
    assert missing.returncode == 2 and "is not a file" in missing.stderr
