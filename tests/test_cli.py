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
    r = run_cli("generate", "--prompt", "hi", "--max-tokens", "3", "--device", "cpu", "--ignore-eos",
                env_extra={"SPECMLA_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "tiny-random-v1" / "model.safetensors").exists()


def test_generate_bad_model_path_is_a_clear_error(tmp_path):
    r = run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "x", "--device", "cpu")
    assert r.returncode == 2
    assert "config.json" in r.stderr
