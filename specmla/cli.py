"""`specmla` command line: generate, serve, bench throughput, bench spec."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path

from specmla import serving_bench
from specmla.bench import (format_report, format_spec_rows, load_prompts, run_spec_sweep, run_throughput,
                           run_transformers)
from specmla.distributed import launched_by_torchrun
from specmla.engine.llm import LLM, worker_main
from specmla.engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS
from specmla.config import ModelConfig
from specmla.model.default import default_model_path
from specmla.model.loader import LOAD_FORMATS, CheckpointError, _checkpoint_files
from specmla.ops.decode.tune import ROUTE_CANDIDATES
from specmla.sampling_params import SamplingParams
from specmla.tokenizer import Tokenizer


DTYPES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8_ds_mla", "fp8", "tbq4")
MAX_PAGE_SIZE = 1024
SERVE_GPU_MAX_NUM_SEQS = 512  # `serve` on a GPU: a request stream's batches (docs/benchmarks.md, serving)
SERVE_GPU_MAX_NUM_BATCHED_TOKENS = 8192
INT64_MAX = 2**63 - 1


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the reason and where to look, not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def _int(lo: int | None = None, hi: int | None = None, what: str = "an integer"):
    """argparse type: an int in [lo, hi]; a bad value is a one-line argparse error (exit code 2)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is out of range: expected {what}")
        return v
    return parse


def _float(lo: float, hi: float, what: str, lo_open: bool = False):
    """argparse type: a finite float in [lo, hi] ((lo, hi] with lo_open)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or v < lo or (lo_open and v == lo) or v > hi:
            raise argparse.ArgumentTypeError(f"{text} is out of range: expected {what}")
        return v
    return parse


def _page_size(text: str) -> int:
    v = _int(1, MAX_PAGE_SIZE, f"a power of two from 1 to {MAX_PAGE_SIZE}")(text)
    if v & (v - 1):
        raise argparse.ArgumentTypeError(f"{v} is not a power of two (1, 2, 4, ..., {MAX_PAGE_SIZE})")
    return v


def _device(text: str) -> str:
    """cpu | cuda | cuda:N, and a CUDA device only where torch sees one."""
    m = re.fullmatch(r"cpu|cuda(?::(\d+))?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: expected cpu, cuda or cuda:N")
    if text.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            why = "torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available ({why}); use --device cpu")
        if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def _input_file(text: str) -> str:
    """A file to read, checked before the model loads."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not readable")
    return text


def _output_file(text: str) -> str:
    """A file to write at the end of a benchmark: its directory must exist now, not after the run."""
    parent = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r} (no such writable directory, or a directory)")
    return text


def _nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory (default: the embedded model)")
    p.add_argument("--device", type=_device, default=None,
                   help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--load-format", default="safetensors", choices=LOAD_FORMATS,
                   help="dummy: random weights of config.json's shapes, built on the device (benchmarks)")
    p.add_argument("--weights", default="auto", choices=["auto", "dequantize"],
                   help="FP8 checkpoints: run the block-scaled e4m3 weights as stored (auto) or dequantise them to "
                        "--dtype at load")
    p.add_argument("--page-size", type=_page_size, default=64, help="tokens per KV page: a power of two")
    p.add_argument("--num-pages", type=_int(1, None, ">= 1"), default=None,
                   help="KV pool size in pages (default: sized from the free memory)")
    p.add_argument("--max-model-len", type=_int(2, None, ">= 2"), default=None)
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=_int(1, 1024, ">= 1"), default=1,
                   help="tensor-parallel ranks (spawned here, or the ranks of a torchrun launch)")
    p.add_argument("--speculative", choices=["auto", "none", "ngram", "mtp", "hybrid"], default=None,
                   help="speculative decoding proposer; auto: MTP where the model has MTP layers (n-gram otherwise), "
                        "each step speculating or not, whichever is faster (default: auto for `generate` and "
                        "`serve` on a model with MTP layers, none otherwise)")
    p.add_argument("--num-speculative-tokens", type=_int(1, 64, "1 to 64"), default=3,
                   help="draft tokens per step (with --speculative auto: the most)")
    p.add_argument("--ngram-min", type=_int(1, 1024, "1 to 1024"), default=1)
    p.add_argument("--ngram-max", type=_int(1, 1024, "1 to 1024"), default=3)
    p.add_argument("--enforce-eager", action="store_true",
                   help="GPU: no CUDA graphs and no warm-up (a faster start; kernels then compile on first use)")


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks across flags (argparse's one-line error, exit code 2)."""
    if getattr(args, "ngram_min", 1) > getattr(args, "ngram_max", 1):
        parser.error(f"--ngram-min ({args.ngram_min}) must be <= --ngram-max ({args.ngram_max})")
    if getattr(args, "func", None) is cmd_bench_spec and getattr(args, "tp", 1) > 1:
        parser.error("bench spec builds one engine per configuration, which tensor-parallel ranks cannot follow: "
                     "use --tp 1")
    if getattr(args, "command", None) == "serve" and (not launched_by_torchrun() or os.environ["RANK"] == "0"):
        try:
            socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            parser.error(f"argument --host: cannot resolve {args.host!r} ({e})")
        try:  # a port in use fails here, before the model starts loading
            family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
                s.bind((args.host, args.port))
        except OSError as e:
            parser.error(f"argument --port: cannot listen on {args.host}:{args.port}: {e.strerror or e}")


def preflight_model(model, need_tokenizer: bool, speculative: str | None = None,
                    load_format: str = "safetensors") -> None:
    """Fail fast, with a one-line reason, on the model directory problems that would otherwise surface
    only after (or, under `serve`, in the background of) a load: no directory, an unreadable or invalid
    config.json, no weights (load_format "dummy" needs none), no tokenizer, MTP speculation on a model without
    MTP layers (in the checkpoint; for "dummy", in config.json)."""
    if model is None:
        return  # the embedded default model (built on first run)
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist" if not path.exists()
                                else f"{path} is not a model directory")
    cfg = ModelConfig.from_file(path)
    names = _checkpoint_files(path) if load_format == "safetensors" else None
    if need_tokenizer and not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    if need_tokenizer:  # a tokenizer that would fail every request stops the start, not each request
        Tokenizer(path).check(cfg.vocab_size)
    if speculative in ("mtp", "hybrid") and not _has_mtp(cfg, names):
        raise ValueError(f"--speculative {speculative} needs a model with MTP layers; {path} has none")


def _has_mtp(cfg: ModelConfig, names) -> bool:
    """Whether the model has MTP layers: in config.json and, where the checkpoint's tensor names are known, there."""
    return bool(cfg.num_nextn_predict_layers) and (names is None or any(
        n.startswith(f"model.layers.{cfg.num_hidden_layers}.") for n in names))


def resolve_speculative(args: argparse.Namespace, model) -> None:
    """`generate` and `serve`: --speculative left out means auto on a model with MTP layers and none otherwise;
    `none` means none. Call after `preflight_model`."""
    if args.speculative == "none":
        args.speculative = None
    elif args.speculative is None:
        path = Path(model) if model is not None else default_model_path()
        names = _checkpoint_files(path) if args.load_format == "safetensors" else None
        if _has_mtp(ModelConfig.from_file(path), names):
            args.speculative = "auto"


def _spec_kwargs(args: argparse.Namespace) -> dict:
    """Speculative-decoding, tensor-parallel and graph options shared by the commands that build an LLM."""
    speculative = None if args.speculative == "none" else args.speculative
    return dict(speculative=speculative, num_speculative_tokens=args.num_speculative_tokens,
                ngram_min=args.ngram_min, ngram_max=args.ngram_max, tensor_parallel_size=args.tp,
                enforce_eager=args.enforce_eager)


def _stream(llm: LLM, prompt: str, params: SamplingParams):
    """Yield the request's text as it grows (LLM.stream's loop); a failed request yields nothing more: the
    engine puts its reason in the text, which goes to stderr, not into the output."""
    seq = llm.engine.add_request(prompt, params)
    holdback = max((len(s) for s in params.stop), default=1) - 1  # a stop string may be forming
    emitted = 0
    while not seq.is_finished:
        llm.engine.step()
        if seq.finish_reason == "error":
            break
        safe = len(seq.text) - (0 if seq.is_finished else holdback)
        if safe > emitted:
            yield seq.text[emitted:safe]
            emitted = safe
    if seq.finish_reason != "error" and len(seq.text) > emitted:
        yield seq.text[emitted:]
    llm.last_output = llm.engine.output_of(seq)


def cmd_generate(args: argparse.Namespace) -> int:
    preflight_model(args.model, need_tokenizer=True, speculative=args.speculative, load_format=args.load_format)
    resolve_speculative(args, args.model)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop or None, ignore_eos=args.ignore_eos,
    )
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, weights=args.weights, load_format=args.load_format,
              page_size=args.page_size,
              num_pages=args.num_pages, max_model_len=args.max_model_len, **_spec_kwargs(args))
    load_s = time.perf_counter() - t0
    print(f"[specmla] model {llm.model_path} loaded in {load_s:.1f} s", file=sys.stderr)
    n_prompt = len(llm.tokenizer.encode(args.prompt))
    pool = llm.kv_pool
    need = -(-min(n_prompt + args.max_tokens, llm.engine.max_model_len) // pool.page_size)  # decoding ends there
    if need > pool.num_pages:
        raise ValueError(f"the prompt ({n_prompt} tokens) and --max-tokens {args.max_tokens} need {need} KV pages "
                         f"of {pool.page_size} tokens; the pool has {pool.num_pages} (raise --num-pages)")
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    for delta in _stream(llm, args.prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    out = llm.last_output
    if out.finish_reason == "error":
        print(f"specmla: error: the request failed: {out.text or 'no reason given'}", file=sys.stderr)
        return 1
    m = out.metrics
    n = m["generated_tokens"]
    decode_s = (m["tpot_s"] or 0.0) * max(n - 1, 0)
    tps = (n - 1) / decode_s if decode_s > 0 else float("nan")
    print(
        f"[specmla] {n} tokens in {m['e2e_s']:.2f} s | prompt {m['prompt_tokens']} tokens, "
        f"TTFT {m['ttft_s'] * 1000:.0f} ms | decode {tps:.1f} tokens/s | finish: {out.finish_reason}",
        file=sys.stderr,
    )
    if args.speculative:
        sp = m["spec"]
        name = f"auto ({llm.speculative})" if args.speculative == "auto" else args.speculative
        print(f"[specmla] speculative {name}: {sp['num_accepted_tokens']}/{sp['num_draft_tokens']} draft "
              f"tokens accepted, mean acceptance length {sp['mean_acceptance_length']:.2f}", file=sys.stderr)
    return 0


def _load_prompts(args: argparse.Namespace, vocab_size: int, n: int | None = None) -> list:
    """The benchmark's prompts; a bad --dataset file is an error that names it."""
    try:
        prompts = load_prompts(args.dataset, n or args.num_prompts, args.input_len, vocab_size, args.seed)
    except (KeyError, TypeError, ValueError) as e:  # a JSON line without "prompt", not UTF-8, no prompts
        if not args.dataset:
            raise
        what = f"a JSON line has no {e.args[0]!r} key" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"--dataset {args.dataset}: {what}") from e
    if args.dataset and not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"--dataset {args.dataset}: every \"prompt\" must be a string")
    return prompts


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    preflight_model(args.model, need_tokenizer=bool(args.dataset), speculative=args.speculative,
                    load_format=args.load_format)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, weights=args.weights, load_format=args.load_format,
              page_size=args.page_size,
              num_pages=args.num_pages, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, **_spec_kwargs(args))
    prompts = _load_prompts(args, llm.model.config.vocab_size)
    result = {"specmla": run_throughput(llm, prompts, args.output_len)}
    print(format_report(result["specmla"]))
    if args.compare_transformers:
        if args.dataset:
            prompts = [llm.tokenizer.encode(p) for p in prompts]
        dtype = next(llm.model.parameters()).dtype
        device = str(llm.kv_pool.device)
        del llm
        hf = run_transformers(str(args.model or default_model_path()), prompts, args.output_len,
                              args.hf_batch or args.num_prompts, device, dtype)
        result["transformers"] = hf
        print(f"transformers generate: {hf['output_tok_per_s']:.1f} output tok/s "
              f"({hf['output_tokens']} tokens in {hf['duration_s']:.2f} s); specmla / transformers = "
              f"{result['specmla']['output_tok_per_s'] / hf['output_tok_per_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def cmd_bench_spec(args: argparse.Namespace) -> int:
    def make_llm(mode, k, batch):
        return LLM(args.model, device=args.device, dtype=args.dtype, weights=args.weights, load_format=args.load_format,
                   page_size=args.page_size,
                   num_pages=args.num_pages, max_model_len=args.max_model_len, max_num_seqs=batch,
                   speculative=mode, num_speculative_tokens=k, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                   tensor_parallel_size=args.tp)

    preflight_model(args.model, need_tokenizer=bool(args.dataset),
                    speculative="mtp" if {"mtp", "hybrid"} & set(args.modes) else None, load_format=args.load_format)
    vocab = make_llm(None, 1, 1).model.config.vocab_size
    results = []
    for B in args.batch:  # B requests at a time (max_num_seqs), over max(B, --num-prompts) prompts
        prompts = _load_prompts(args, vocab, max(B, args.num_prompts or B))
        rows = run_spec_sweep(lambda mode, k, B=B: make_llm(mode, k, B), prompts, args.output_len, args.modes,
                              args.k, batch=B, rounds=args.rounds)
        print(f"batch {B}:\n{format_spec_rows(rows)}")
        results += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from specmla.server.app import build_server, create_app  # the web stack loads for `serve` only

    model = args.model_pos or args.model
    preflight_model(model, need_tokenizer=True, speculative=args.speculative, load_format=args.load_format)
    resolve_speculative(args, model)
    name = args.served_model_name or (str(model) if model else "specmla-default")
    failure: list[BaseException] = []
    loaded = threading.Event()  # the loader thread is done (returned or raised)

    def load():
        try:
            return LLM(model, device=args.device, dtype=args.dtype, weights=args.weights, load_format=args.load_format,
                       page_size=args.page_size,
                       num_pages=args.num_pages, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=args.kv_cache_dtype,
                       on_phase=lambda p: app.state.specmla.update(phase=p),
                       **_spec_kwargs(args))
        finally:
            loaded.set()

    def load_failed(e: BaseException) -> None:  # a server without a model serves nothing: stop it, exit non-zero
        failure.append(e)
        server.should_exit = True

    app = create_app(load, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     body_timeout_s=args.read_timeout, on_load_error=load_failed)
    server = build_server(app, args.host, args.port, args.log_level, args.shutdown_timeout, args.read_timeout)
    try:
        server.run()
        code = 0 if server.started and not server.load_failed else 1
    except SystemExit as e:  # uvicorn's startup failures (e.g. the port taken since the check)
        code = e.code if isinstance(e.code, int) else 1
    if failure:
        e = failure[0]
        print(f"specmla: error: loading the model failed: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    if not loaded.is_set():  # interpreter teardown under a thread still inside torch aborts (SIGABRT)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def cmd_tune(args: argparse.Namespace) -> int:
    from specmla import tune

    cfg = ModelConfig.from_file(Path(args.config or args.model or default_model_path()))
    query = [1] + ([1 + args.num_speculative_tokens] if args.num_speculative_tokens else [])
    gpu = _cuda_available()
    if args.check:
        if args.device_name is None and not gpu:
            print("no CUDA GPU here: the ops run their portable kernels and references, which take no tables "
                  "(--device-name NAME checks a GPU's tables by its CUDA name)")
            return 0
        import torch

        name = args.device_name or torch.cuda.get_device_name(0)
        print(tune.format_check(name, tune.check(name, cfg, args.kv_formats, query)))
        return 0
    if not gpu:
        print("specmla: error: tune measures on a CUDA GPU and none is visible here (--check works anywhere)",
              file=sys.stderr)
        return 2
    import torch

    device, written = torch.device("cuda"), []
    ops, skipped = tune.applicable_ops(cfg, args.ops)
    for op, why in skipped.items():
        print(f"{op}: {why}; nothing to tune")
    budget = args.budget / max(1, len(ops))  # shared by the ops that apply
    if "decode" in ops:
        written += tune.tune_decode(cfg, device, args.kv_formats, query, budget, args.out)
    if "moe" in ops:
        written += tune.tune_moe(cfg, device, budget, args.out)
    if "fp8" in ops:
        written += tune.tune_linear(cfg, device, budget, args.out)
    for path in written:
        print(f"wrote {path}")
    return 0


def _output_dir(text: str) -> str:
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def _names(allowed: tuple[str, ...], what: str):
    """A comma-separated list of some of `allowed` (at least one)."""
    def parse(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        if not out or any(x not in allowed for x in out):
            raise argparse.ArgumentTypeError(f"{what} from {', '.join(allowed)} (comma-separated), got {text!r}")
        return out
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specmla", description="MLA inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    _add_model_args(g)
    g.add_argument("--prompt", required=True, type=_nonempty)
    g.add_argument("--max-tokens", type=_int(1, None, ">= 1"), default=64)
    g.add_argument("--temperature", type=_float(0.0, 100.0, "a number from 0 to 100"), default=0.0,
                   help="0 = greedy (default)")
    g.add_argument("--top-p", type=_float(0.0, 1.0, "a number in (0, 1]", lo_open=True),
                   default=1.0)
    g.add_argument("--top-k", type=_int(-1, 2**31 - 1, "-1 (off), 0 (off) or >= 1"), default=-1)
    g.add_argument("--seed", type=_int(0, INT64_MAX, f"0 to {INT64_MAX}"), default=None)
    g.add_argument("--stop", action="append", type=_nonempty, default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    sv.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help="model directory")
    _add_model_args(sv)
    sv.add_argument("--host", type=_nonempty, default="127.0.0.1")
    sv.add_argument("--port", type=_int(1, 65535, "1 to 65535"), default=8000)
    sv.add_argument("--api-key", type=_nonempty, default=None)
    sv.add_argument("--served-model-name", type=_nonempty, default=None)
    sv.add_argument("--max-num-seqs", type=_int(1, None, ">= 1"), default=None,
                    help=f"requests decoding at once (default: {SERVE_GPU_MAX_NUM_SEQS} on a GPU, 64 on the CPU)")
    sv.add_argument("--max-num-batched-tokens", type=_int(1, None, ">= 1"), default=None,
                    help=f"tokens a step (default: {SERVE_GPU_MAX_NUM_BATCHED_TOKENS} on a GPU, "
                         f"{DEFAULT_MAX_NUM_BATCHED_TOKENS} on the CPU)")
    sv.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    sv.add_argument("--log-level", default="warning",
                    choices=["critical", "error", "warning", "info", "debug", "trace"])
    sv.add_argument("--shutdown-timeout", type=_float(0.0, 86400.0, "seconds from 0 to 86400"), default=30.0,
                    help="after SIGTERM, requests in flight get this long, then end with an error (default 30)")
    sv.add_argument("--max-body-bytes", type=_int(1, None, ">= 1"), default=16 << 20,
                    help="larger request bodies get a 413 (default 16 MiB)")
    sv.add_argument("--read-timeout", type=_float(0.1, 3600.0, "seconds from 0.1 to 3600"), default=20.0,
                    help="a request's headers, then its body, must arrive within this many seconds: a connection "
                         "that sends no headers is closed, a body late gets a 408 (default 20)")
    sv.set_defaults(func=cmd_serve)

    tu = sub.add_parser("tune", help="measure a model's decode routes and fused-MoE tiles on this GPU into the user's "
                                     "tables; --check lists the model's shapes that run untuned (on the rules)")
    tu.add_argument("--check", action="store_true", help="list, do not measure")
    tu.add_argument("--ops", type=_names(("decode", "moe", "fp8"), "ops"), default=["decode", "moe", "fp8"],
                    help="what to measure: decode,moe,fp8 (default all; fp8 only for a checkpoint with FP8 weights)")
    tu.add_argument("--budget", type=_float(1.0, 86400.0, "seconds from 1 to 86400"), default=420.0,
                    help="seconds the measurement may take, shared by the ops (default 420)")
    tu.add_argument("--out", type=_output_dir, default=None,
                    help="also write the tables here (<table>/<device>.json, the package's layout for shipping)")
    src = tu.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="HF model directory (default: the embedded model)")
    src.add_argument("--config", type=_input_file, default=None,
                     help="a model's config.json alone: its shapes are tuned without its weights")
    tu.add_argument("--device-name", default=None, help="check this CUDA device name's tables (default: GPU 0)")
    tu.add_argument("--kv-formats", type=_names(tuple(ROUTE_CANDIDATES), "formats"), default=["bf16"], help="cache formats served (comma-separated)")
    tu.add_argument("--num-speculative-tokens", type=_int(0, 64, "0 to 64"), default=0,
                    help="k: the verify step's 1 + k query tokens are checked too")
    tu.set_defaults(func=cmd_tune)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    t = bench.add_parser("throughput", help="offline throughput of N prompts: tok/s, TTFT, TPOT")
    _add_model_args(t)
    t.add_argument("--num-prompts", type=_int(1, None, ">= 1"), default=32)
    t.add_argument("--input-len", type=_int(1, None, ">= 1"), default=128, help="random prompt length (no --dataset)")
    t.add_argument("--output-len", type=_int(1, None, ">= 1"), default=128)
    t.add_argument("--dataset", type=_input_file, default=None,
                   help="file: one prompt per line, or JSON lines with 'prompt'")
    t.add_argument("--max-num-seqs", type=_int(1, None, ">= 1"), default=64)
    t.add_argument("--max-num-batched-tokens", type=_int(1, None, ">= 1"),
                   default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    t.add_argument("--seed", type=_int(0, INT64_MAX, f"0 to {INT64_MAX}"), default=0)
    t.add_argument("--compare-transformers", action="store_true", help="also time transformers' generate")
    t.add_argument("--hf-batch", type=_int(1, None, ">= 1"), default=None,
                   help="transformers batch size (default: all prompts)")
    t.add_argument("--json", type=_output_file, default=None, help="write the results here")
    t.set_defaults(func=cmd_bench_throughput)

    sp = bench.add_parser("spec", help="speculative decoding sweep: none / mtp / ngram / hybrid / auto × k × batch")
    _add_model_args(sp)
    sp.add_argument("--modes", nargs="+", default=["none", "mtp", "ngram", "hybrid", "auto"],
                    choices=["none", "mtp", "ngram", "hybrid", "auto"],
                    help="auto: --speculative auto with k_max = each --k")
    sp.add_argument("--k", type=_int(1, 64, "1 to 64"), nargs="+", default=[1, 2, 3, 4], help="draft lengths")
    sp.add_argument("--batch", type=_int(1, None, ">= 1"), nargs="+", default=[1, 32])
    sp.add_argument("--input-len", type=_int(1, None, ">= 1"), default=128)
    sp.add_argument("--num-prompts", type=_int(1, None, ">= 1"), default=None,
                    help="prompts in all (default: the batch size)")
    sp.add_argument("--output-len", type=_int(1, None, ">= 1"), default=128)
    sp.add_argument("--dataset", type=_input_file, default=None, help="prompts file (e.g. code-editing prompts)")
    sp.add_argument("--seed", type=_int(0, INT64_MAX, f"0 to {INT64_MAX}"), default=0)
    sp.add_argument("--rounds", type=_int(1, None, ">= 1"), default=1,
                    help="time every configuration this many times, interleaved, and report medians")
    sp.add_argument("--json", type=_output_file, default=None)
    sp.set_defaults(func=cmd_bench_spec, speculative=None)

    bs = bench.add_parser("serve", help="a request stream against an OpenAI-compatible server: TTFT, TPOT, ITL, "
                                        "throughput (specmla/serving_bench.py, also a standalone script)")
    serving_bench.add_arguments(bs)
    bs.set_defaults(func=serving_bench.run)
    return parser


def resolve_serve_batching(args: argparse.Namespace) -> None:
    """`serve`'s --max-num-seqs / --max-num-batched-tokens left out: a server's request stream fills large batches,
    so on a GPU it batches as vLLM's server does on a large GPU (memory caps the KV pool, not these); the CPU keeps
    the offline defaults."""
    if getattr(args, "command", None) != "serve":
        return
    on_gpu = args.device.startswith("cuda") if args.device else _cuda_available()
    if args.max_num_seqs is None:
        args.max_num_seqs = SERVE_GPU_MAX_NUM_SEQS if on_gpu else 64
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = SERVE_GPU_MAX_NUM_BATCHED_TOKENS if on_gpu else DEFAULT_MAX_NUM_BATCHED_TOKENS


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _torchrun_worker(args: argparse.Namespace) -> int | None:
    """Under torchrun, ranks > 0 do not run the command: they build the engine rank 0's command builds, on their
    shard, and follow rank 0's request stream."""
    if not launched_by_torchrun() or int(os.environ["RANK"]) == 0:
        return None
    model = getattr(args, "model_pos", None) or args.model
    if model is None:
        model = default_model_path()
    kwargs = dict(device=args.device, dtype=args.dtype, weights=args.weights, load_format=args.load_format,
                  page_size=args.page_size,
                  num_pages=args.num_pages, max_model_len=args.max_model_len,
                  max_num_seqs=getattr(args, "max_num_seqs", 64),
                  max_num_batched_tokens=getattr(args, "max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS),
                  kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                  **{k: v for k, v in _spec_kwargs(args).items() if k != "tensor_parallel_size"})
    worker_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, str(model), kwargs)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    resolve_serve_batching(args)
    if not logging.getLogger().handlers:  # the engine's start-up lines (warm-up time, memory split) on stderr
        logging.basicConfig(level=logging.WARNING, format="[specmla] %(message)s", stream=sys.stderr)
    logging.getLogger("specmla.engine").setLevel(logging.INFO)
    if launched_by_torchrun() and getattr(args, "num_pages", 0) is None:
        print("specmla: error: under torchrun pass --num-pages, so that every rank's KV pool has the same size",
              file=sys.stderr)
        return 2
    if getattr(args, "tp", 1) > 1:
        code = _torchrun_worker(args)
        if code is not None:
            return code
    try:
        return args.func(args)
    except (ValueError, OSError, NotImplementedError, CheckpointError) as e:
        print(f"specmla: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specmla: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
