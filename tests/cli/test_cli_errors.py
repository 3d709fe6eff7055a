"""Bad flags, bad model directories and failed requests end the CLI with a one-line reason on stderr and a
non-zero exit code, never a traceback. The flag table runs `main()` in-process (argparse exits before any
model loads); the end-to-end cases run `python -m specmla.cli` in subprocesses started together."""

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import specmla.cli as cli_module
from specmla.cli import build_parser, main
from specmla.config import ModelConfig

NO_SUCH_GPU = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: an error with or without CUDA

BAD_FLAGS = [
    (["generate", "--prompt", "x", "--page-size", "0"], "argument --page-size: 0 is out of range"),
    (["generate", "--prompt", "x", "--page-size", "3"], "argument --page-size: 3 is not a power of two"),
    (["generate", "--prompt", "x", "--page-size", "4096"], "argument --page-size: 4096 is out of range"),
    (["generate", "--prompt", "x", "--num-pages", "0"], "argument --num-pages: 0 is out of range"),
    (["generate", "--prompt", "x", "--max-model-len", "-5"], "argument --max-model-len: -5 is out of range"),
    (["generate", "--prompt", "x", "--dtype", "bogus"], "argument --dtype: invalid choice: 'bogus'"),
    (["generate", "--prompt", "x", "--device", "tpu"], "argument --device: 'tpu' is not a device"),
    (["generate", "--prompt", "x", "--device", NO_SUCH_GPU], f"argument --device: '{NO_SUCH_GPU}'"),
    (["generate", "--prompt", "x", "--temperature", "nan"], "argument --temperature: nan is out of range"),
    (["generate", "--prompt", "x", "--temperature", "inf"], "argument --temperature: inf is out of range"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "argument --temperature: -1 is out of range"),
    (["generate", "--prompt", "x", "--top-p", "0"], "argument --top-p: 0 is out of range"),
    (["generate", "--prompt", "x", "--top-k", "1.5"], "argument --top-k: '1.5' is not an integer"),
    (["generate", "--prompt", "x", "--seed", str(2**63)], "argument --seed: 9223372036854775808 is out of range"),
    (["generate", "--prompt", "x", "--max-tokens", "0"], "argument --max-tokens: 0 is out of range"),
    (["generate", "--prompt", ""], "argument --prompt: must not be empty"),
    (["generate", "--prompt", "x", "--stop", ""], "argument --stop: must not be empty"),
    (["generate", "--prompt", "x", "--tp", "0"], "argument --tp/--tensor-parallel-size: 0 is out of range"),
    (["generate", "--prompt", "x", "--num-speculative-tokens", "0"], "argument --num-speculative-tokens: 0 is out"),
    (["generate", "--prompt", "x", "--ngram-min", "4", "--ngram-max", "2"], "--ngram-min (4) must be <= --ngram-max"),
    (["generate", "--prompt", "x", "--speculative", "eagle"], "argument --speculative: invalid choice: 'eagle'"),
    (["serve", "--port", "99999"], "argument --port: 99999 is out of range: expected 1 to 65535"),
    (["serve", "--port", "0"], "argument --port: 0 is out of range"),
    (["serve", "--port", "http"], "argument --port: 'http' is not an integer"),
    (["serve", "--host", ""], "argument --host: must not be empty"),
    (["serve", "--host", "no-such-host.invalid"], "argument --host: cannot resolve 'no-such-host.invalid'"),
    (["serve", "--api-key", " "], "argument --api-key: must not be empty"),
    (["serve", "--kv-cache-dtype", "int4"], "argument --kv-cache-dtype: invalid choice: 'int4'"),
    (["serve", "--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    (["serve", "--max-num-seqs", "0"], "argument --max-num-seqs: 0 is out of range"),
    (["serve", "--max-num-batched-tokens", "-1"], "argument --max-num-batched-tokens: -1 is out of range"),
    (["bench", "throughput", "--num-prompts", "0"], "argument --num-prompts: 0 is out of range"),
    (["bench", "throughput", "--output-len", "0"], "argument --output-len: 0 is out of range"),
    (["bench", "throughput", "--dataset", "/no/such/prompts.txt"], "--dataset: '/no/such/prompts.txt' is not a"),
    (["bench", "throughput", "--json", "/no/such/dir/r.json"], "argument --json: cannot write '/no/such/dir/r.json'"),
    (["bench", "spec", "--k", "0"], "argument --k: 0 is out of range"),
    (["bench", "spec", "--batch", "1", "0"], "argument --batch: 0 is out of range"),
    (["bench", "spec", "--rounds", "0"], "argument --rounds: 0 is out of range"),
    (["bench", "spec", "--modes", "eagle"], "argument --modes: invalid choice: 'eagle'"),
    (["bench", "spec", "--tp", "2"], "bench spec builds one engine per configuration"),
]


@pytest.mark.parametrize("argv,reason", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flag_is_a_one_line_argparse_error(argv, reason, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: " in err and reason in err, err


def test_device_cuda_without_cuda_is_an_argparse_error(capsys):
    if torch.cuda.is_available():  # valid here; NO_SUCH_GPU above covers the error
        assert build_parser().parse_args(["generate", "--prompt", "x", "--device", "cuda"]).device == "cuda"
        return
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "x", "--device", "cuda"])
    assert exc.value.code == 2
    assert "argument --device: 'cuda': CUDA is not available" in capsys.readouterr().err


def test_config_errors_name_the_file(tmp_path):
    cfg = tmp_path / "config.json"
    for text, reason in [('{"architectures": [', "is not valid JSON"), ("[1, 2]", "holds a JSON list, not an object"),
                         ('{"architectures": ["DeepseekV3ForCausalLM"]}', "lacks the key 'num_attention_heads'"),
                         (b"\xff\xfe{", "is not valid JSON")]:
        cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ValueError) as exc:
            ModelConfig.from_file(tmp_path)
        assert str(cfg) in str(exc.value) and reason in str(exc.value)
    cfg.write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="unsupported architecture") as exc:
        ModelConfig.from_file(tmp_path)
    assert str(cfg) in str(exc.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_variant(src, dst, config=None, drop=lambda name: False, remove=()):
    shutil.copytree(src, dst)
    if config is not None:
        (dst / "config.json").write_text(config)
    for name in remove:
        (dst / name).unlink()
    if (dst / "model.safetensors").exists():
        tensors = load_file(dst / "model.safetensors")
        if any(drop(n) for n in tensors):
            save_file({n: t for n, t in tensors.items() if not drop(n)}, dst / "model.safetensors")
    return dst


@pytest.fixture(scope="module")
def cli_runs(tiny_model_dir, tmp_path_factory):
    """Every end-to-end case, started at once (each is a short process: ~2 s of imports, a tiny model)."""
    tmp = tmp_path_factory.mktemp("cli_errors")
    tiny = str(tiny_model_dir)
    corrupt = _model_variant(tiny_model_dir, tmp / "corrupt", config='{"vocab_size": 259,')
    missing = _model_variant(tiny_model_dir, tmp / "missing", drop=lambda n: n == "model.layers.0.mlp.down_proj.weight")
    cases = {
        "port_99999": ["serve", tiny, "--port", "99999"],
        "serve_nonexistent": ["serve", "--model", str(tmp / "nonexistent"), "--device", "cpu"],
        "serve_corrupt_config": ["serve", str(corrupt), "--device", "cpu"],
        "serve_load_fails": ["serve", str(missing), "--device", "cpu", "--port", str(_free_port())],
        "generate_pool_too_small": ["generate", "--model", tiny, "--device", "cpu", "--prompt", "hello",
                                    "--max-tokens", "100", "--num-pages", "1"],
    }
    procs = {k: subprocess.Popen([sys.executable, "-m", "specmla.cli", *argv], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=dict(os.environ))
             for k, argv in cases.items()}
    runs = {}
    try:
        for k, p in procs.items():
            out, err = p.communicate(timeout=120)
            runs[k] = (p.returncode, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return runs, tmp


E2E = {
    "port_99999": (2, "specmla serve: error: argument --port: 99999 is out of range"),
    "serve_nonexistent": (2, "specmla: error: model directory {tmp}/nonexistent does not exist"),
    "serve_corrupt_config": (2, "specmla: error: {tmp}/corrupt/config.json is not valid JSON"),
    "serve_load_fails": (1, "specmla: error: loading the model failed: CheckpointError: {tmp}/missing: missing "
                            "tensor(s) ['model.layers.0.mlp.down_proj.weight']"),
    "generate_pool_too_small": (2, "need 2 KV pages of 64 tokens; the pool has 1 (raise --num-pages)"),
}


@pytest.mark.parametrize("case", sorted(E2E))
def test_cli_failure_is_one_line_and_nonzero(cli_runs, case):
    runs, tmp = cli_runs
    rc, out, err = runs[case]
    code, reason = E2E[case]
    assert "Traceback" not in err, err
    assert rc == code, err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and reason.format(tmp=tmp) in errors[0], err
    assert "error" not in out


def test_generate_exits_nonzero_with_the_reason_when_the_request_fails(tiny_model_dir, capsys, monkeypatch):
    """A request the engine ends with finish_reason "error" (the engine puts the reason in its text) prints
    the reason on stderr, keeps it out of the generated text, and exits 1."""
    import specmla.cli as cli

    real_llm = cli.LLM

    def failing_llm(*args, **kwargs):
        llm = real_llm(*args, **kwargs)
        real_step = llm.engine.step

        def step():
            out = real_step()
            for seq in out:
                if len(seq.output_ids) == 2 and not seq.is_finished:  # fail the request after two tokens
                    seq.text = "injected failure"
                    llm.engine._finish(seq, "error")
            return out

        llm.engine.step = step
        return llm

    monkeypatch.setattr(cli, "LLM", failing_llm)
    rc = main(["generate", "--model", str(tiny_model_dir), "--device", "cpu", "--prompt", "hello",
               "--max-tokens", "8", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert out.startswith("hello") and "injected" not in out
    assert "specmla: error: the request failed: injected failure" in err
    assert "finish:" not in err


def test_model_directory_problems_are_found_before_loading(tiny_model_dir, tmp_path, capsys):
    """`serve` checks the directory in the foreground (no server starts): the failures exit at once."""
    variants = {
        "no_tok": dict(remove=["tokenizer.json"]),
        "no_weights": dict(remove=["model.safetensors"]),
        "no_mtp": dict(drop=lambda n: n.startswith("model.layers.2.")),
        "corrupt": dict(config='{"vocab_size": 259,'),
    }
    for name, kw in variants.items():
        _model_variant(tiny_model_dir, tmp_path / name, **kw)
    for argv, reason in [
        (["serve", str(tmp_path / "no_tok")], f"no tokenizer.json in {tmp_path}/no_tok"),
        (["serve", str(tmp_path / "no_weights")], f"{tmp_path}/no_weights has neither model.safetensors"),
        (["serve", str(tmp_path / "no_mtp"), "--speculative", "mtp"], "--speculative mtp needs a model with MTP"),
        (["generate", "--model", str(tmp_path / "no_mtp"), "--prompt", "x", "--speculative", "hybrid"],
         "--speculative hybrid needs a model with MTP"),
        (["generate", "--model", str(tmp_path / "corrupt"), "--prompt", "x"],
         f"{tmp_path}/corrupt/config.json is not valid JSON"),
        (["bench", "throughput", "--model", str(tmp_path / "nothing")], f"model directory {tmp_path}/nothing does"),
    ]:
        assert main([*argv, "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("specmla: error: ") and err.count("\n") == 1 and reason in err, err


def test_dataset_and_json_paths_are_checked_before_the_model_loads(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    for argv, reason in [(["--dataset", str(tmp_path / "d")], "is not a file"),
                         (["--json", str(tmp_path / "d")], "cannot write")]:
        with pytest.raises(SystemExit):
            main(["bench", "throughput", "--model", str(tmp_path / "never-read"), *argv])
        assert reason in capsys.readouterr().err


def test_serve_on_a_port_in_use_fails_before_loading(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--model", "/never/read", "--port", str(port)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument --port: cannot listen on 127.0.0.1:{port}" in err, err


def test_bad_dataset_lines_are_errors_that_name_the_file(tiny_model_dir, tmp_path, capsys):
    cases = {"nokey.jsonl": ('{"text": "x"}\n', "a JSON line has no 'prompt' key"),
             "int.jsonl": ('{"prompt": 5}\n', 'every "prompt" must be a string'),
             "binary.txt": (b"\xff\xfe bad\n", "can't decode byte 0xff"),
             "blank.txt": ("\n\n", "holds no prompts")}
    for name, (body, reason) in cases.items():
        f = tmp_path / name
        f.write_bytes(body if isinstance(body, bytes) else body.encode())
        with pytest.raises(ValueError) as exc:
            cli_module._load_prompts(build_parser().parse_args(
                ["bench", "throughput", "--dataset", str(f), "--num-prompts", "2"]), 259)
        assert str(exc.value).startswith(f"--dataset {f}: ") and reason in str(exc.value), exc.value
    rc = main(["bench", "throughput", "--model", str(tiny_model_dir), "--device", "cpu", "--dataset",
               str(tmp_path / "nokey.jsonl"), "--num-prompts", "2", "--output-len", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and f"specmla: error: --dataset {tmp_path / 'nokey.jsonl'}: a JSON line has no" in err, err
