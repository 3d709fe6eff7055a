"""`specmla.LLM`: the user-facing entry point (contract C4)."""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import multiprocessing.connection as mp_connection
import os
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.multiprocessing as mp
from tqdm import tqdm

from specmla.distributed import destroy_group, init_group, launched_by_torchrun, local_rank
from specmla.engine import compile_guard, warmup
from specmla.engine.draft_policy import DraftPolicy
from specmla.engine.engine import LLMEngine, RequestOutput, default_num_pages
from specmla.engine.kv_pool import KVPool
from specmla.engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS
from specmla.engine.spec import HybridProposer, MtpProposer, NgramProposer
from specmla.engine.tp_channel import GlooChannel, ShmChannel
from specmla.engine.tp_worker import TPEngine, follow_engine
from specmla.model.deepseek import DeepseekForCausalLM
from specmla.model.default import default_model_path
from specmla.model.fp8 import check_fp8_numerics, fp8_numerics_of, use_fp8_numerics_
from specmla.model.loader import WEIGHTS, load_model
from specmla.ops.all_reduce import symmetric_bytes
from specmla.ops.kv_cache import QUANTIZED
from specmla.sampling_params import SamplingParams
from specmla.tokenizer import Tokenizer

log = logging.getLogger(__name__)

GIB = float(1 << 30)
RESERVE_SLACK, RESERVE_FLOOR = 0.02, 64 << 20  # kept free beyond the measured graphs and activations (allocator
# rounding differs a little between the measuring engine and the served one)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class LLM:
    """Load a model directory (None → the embedded default model) and generate from prompts."""

    def __init__(
        self,
        model: str | Path | DeepseekForCausalLM | None = None,
        *,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        weights: str = "auto",
        fp8_numerics: str = "auto",
        load_format: str = "safetensors",
        speculative: str | None = None,
        num_speculative_tokens: int = 3,
        ngram_min: int = 1,
        ngram_max: int = 3,
        kv_cache_dtype: str = "auto",
        tensor_parallel_size: int = 1,
        page_size: int = 64,
        num_pages: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        custom_all_reduce: bool = True,
        pipeline_decode: bool = True,
        progress: bool = False,
        tokenizer: Tokenizer | None = None,
        on_phase: Callable[[str], None] | None = None,
        _tp_rank: int | None = None,
        _tp_world: int = 1,
    ):
        """`model`: a model directory, None (the embedded default), or an already built
        `DeepseekForCausalLM` (then `tokenizer` may be given; device and dtype are the model's). weights: "auto"
        runs an FP8 checkpoint's block-scaled weights as stored, "dequantize" turns them into dtype at load.
        fp8_numerics: what those FP8 layers run, "auto" (the w8a8 kernels on CUDA, the dequantised reference on CPU)
        or "emulate" (`model.fp8.use_fp8_numerics_`: the torch emulation of the kernels' w8a8 arithmetic,
        DeepSeek's act_quant numerics, on any device; a reference for the kernels, run without CUDA graphs since its
        MoE reads the chosen experts on the host; a built `model` keeps its own setting under "auto").
        load_format: "safetensors" loads the directory's weights, "dummy" builds random ones of its config.json's
        shapes on the device (benchmarks of models too large to write to disk; every rank builds its shard).
        custom_all_reduce: under tensor parallelism on GPUs of one host, small all-reduces use the one-shot kernel
        (`ops.all_reduce`); False sends every all-reduce through NCCL. pipeline_decode: launch the next decode step
        before this one's tokens reach the host (`LLMEngine`); False runs every step after the last.

        On a GPU (unless enforce_eager) the constructor returns once every kernel a step can reach is compiled and
        every CUDA graph captured (`engine.warmup`), the KV pool sized from the memory those left; `startup` then
        holds the times and the memory split, and `engine.compile_guard` reports any later compile (a warning, or an
        error with SPECMLA_COMPILE_GUARD=raise). `on_phase("loading" | "warming up")`: called as the start goes on
        (the server's /health says which)."""
        start = time.perf_counter()
        if on_phase is not None:
            on_phase("loading")
        if weights not in WEIGHTS:
            raise ValueError(f"weights={weights!r}: expected one of {WEIGHTS}")
        check_fp8_numerics(fp8_numerics)
        if speculative not in (None, "auto", "ngram", "mtp", "hybrid"):
            raise ValueError(f"speculative={speculative!r}: expected None, 'auto', 'ngram', 'mtp' or 'hybrid'")
        if tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and one to generate), got {max_model_len}")
        if tensor_parallel_size > 1 and isinstance(model, DeepseekForCausalLM):
            raise ValueError("tensor parallelism needs a model directory (each rank loads its shard)")
        if tensor_parallel_size > 1 and tokenizer is not None:
            raise ValueError("tensor parallelism takes the model directory's tokenizer (every rank loads the same one)")
        if isinstance(model, DeepseekForCausalLM):
            self.model_path = None
            self.model, self.tokenizer = model, tokenizer
            device = next(model.parameters()).device
            if fp8_numerics != "auto":
                use_fp8_numerics_(model, fp8_numerics)
        else:
            if model is None:
                model = default_model_path()
            self.model_path = Path(model)
            device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            if isinstance(dtype, str):
                dtype = _DTYPES[dtype]
            # tensor parallelism: every rank (this one is rank 0 unless it is a worker) loads its shard only
            shard = (_tp_rank, _tp_world) if _tp_rank is not None else (
                (0, tensor_parallel_size) if tensor_parallel_size > 1 else None)
            self.model = load_model(self.model_path, device=device, dtype=dtype, max_positions=max_model_len,
                                    progress=progress, shard=shard, weights=weights, load_format=load_format,
                                    fp8_numerics=fp8_numerics)
            has_tok = (self.model_path / "tokenizer.json").exists()
            self.tokenizer = tokenizer or (Tokenizer(self.model_path) if has_tok else None)
        cache_dtype = next(self.model.parameters()).dtype
        if kv_cache_dtype not in ("auto", "bf16", "fp16", "fp32") + QUANTIZED:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: expected auto | bf16 | fp16 | fp32 | "
                             + " | ".join(QUANTIZED))
        kv_format = kv_cache_dtype if kv_cache_dtype in QUANTIZED else "auto"
        self.model.fuse_input_projections_()  # one GEMM for q and the latent a layer (views: loads still land)
        if kv_format == "tbq4" and self.model.config.kv_lora_rank % 128 == 0:  # (else the pool refuses tbq4)
            self.model.fold_tbq4_rotation_()  # decode launches no rotation; before the pool is sized: a copy
        if kv_cache_dtype in _DTYPES:
            cache_dtype = _DTYPES[kv_cache_dtype]
        max_len = self.model.max_positions
        proposer = None
        auto = speculative == "auto"
        if auto:  # the model's own MTP module where it has one; the tokens so far otherwise
            speculative = "mtp" if len(self.model.mtp) else "ngram"
        self.speculative = speculative
        if speculative == "ngram":
            proposer = NgramProposer(num_speculative_tokens, ngram_min, ngram_max)
        elif speculative in ("mtp", "hybrid"):
            if not len(self.model.mtp):
                raise ValueError(f"speculative={speculative!r} needs a model with MTP layers "
                                 "(num_nextn_predict_layers)")
            proposer = (MtpProposer(num_speculative_tokens) if speculative == "mtp"
                        else HybridProposer(num_speculative_tokens, ngram_min, ngram_max))
        # the emulation's MoE reads the chosen experts on the host: no CUDA graphs
        use_graphs = device.type == "cuda" and not enforce_eager and fp8_numerics_of(self.model) != "emulate"

        tp = tensor_parallel_size > 1 or _tp_rank is not None

        def make_policy() -> DraftPolicy | None:
            # ranks of a tensor-parallel group must take the same steps, which timings measured per rank cannot
            # promise: there `auto` keeps k drafts every step
            if not auto or tp:
                return None
            # exploring the plain side would cost an MTP request its drafts for good (see DraftPolicy): the MTP
            # policy decides on the warm-up's costs alone
            return DraftPolicy(num_speculative_tokens, online=not proposer.uses_mtp)

        def make_engine(pages: int) -> LLMEngine:
            pool = KVPool(self.model.num_cache_layers, pages, page_size, self.model.config.latent_dim, cache_dtype,
                          device, enable_prefix_caching=enable_prefix_caching, scratch_page=True, kv_format=kv_format,
                          kv_lora_rank=self.model.config.kv_lora_rank)
            engine = LLMEngine(self.model, self.tokenizer, pool, max_num_seqs=max_num_seqs, max_model_len=max_len,
                               max_num_batched_tokens=max_num_batched_tokens, proposer=proposer,
                               pipeline_decode=pipeline_decode, policy=make_policy())
            if use_graphs:
                warmup.attach_graphs(engine)
                if engine.policy is not None:
                    engine.policy.padded = engine.runner.graphed.padded_size
            return engine

        loaded = time.perf_counter()
        if on_phase is not None and use_graphs:
            on_phase("warming up")
        # one GPU: a warm-up on a small pool measures what the graphs and activations take before the pool is
        # sized (ranks of a tensor-parallel group size theirs as rank 0 did, before they exist)
        profiled = num_pages is None and use_graphs and not tp
        reserved, free, first = 0, None, None
        if profiled:
            gc.collect()
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(device)[0]
            look = proposer.k if proposer else 0
            groups = warmup.request_groups(self.model.config.vocab_size, max_num_batched_tokens, max_num_seqs,
                                           page_size, max_len - warmup.NEW_TOKENS - look - 1)
            used, first = warmup.measure(make_engine, device, groups, page_size, look, progress or None)
            reserved = used + int(RESERVE_SLACK * used) + RESERVE_FLOOR
            log.info("profile: %s; %.2f GiB set aside for them", first.line(), reserved / GIB)
        if num_pages is None:
            num_pages = default_num_pages(self.model, page_size, cache_dtype, device, max_num_seqs, max_len,
                                          gpu_memory_utilization, kv_format, reserved_bytes=reserved, free_bytes=free)
        self.engine = make_engine(num_pages)
        pool = self.engine.pool
        self._workers, self._stopping, self._channel, self._init_file = [], False, None, None
        if tensor_parallel_size > 1 and _tp_rank is None:
            # every rank builds this same engine (graphs included, their all-reduces captured in lockstep); the
            # other ranks mirror rank 0's pool page for page (sizing from their own free memory could differ)
            self._start_tensor_parallel(tensor_parallel_size, device, dict(
                device=str(device), dtype=dtype, weights=weights, fp8_numerics=fp8_numerics, load_format=load_format,
                speculative=speculative,
                num_speculative_tokens=num_speculative_tokens, ngram_min=ngram_min, ngram_max=ngram_max,
                kv_cache_dtype=kv_cache_dtype, page_size=page_size, num_pages=pool.num_pages,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len,
                enforce_eager=enforce_eager, custom_all_reduce=custom_all_reduce, pipeline_decode=pipeline_decode))
        self.startup: dict = {}  # what the warm-up measured (GPU with graphs): times and the memory split
        if use_graphs:
            # under tensor parallelism every rank captures the same graphs in the same order (their all-reduces
            # pair up); the eager requests are left out there, so that no rank can step alone
            groups = None
            if not profiled and not tp:  # num_pages given: the request groups the pool holds
                every = warmup.engine_groups(self.engine)
                look = self.engine.scheduler.lookahead
                groups = [g for g in every if warmup.pages_needed([g], page_size, look) <= pool.num_pages]
                if len(groups) < len(every):
                    log.warning("the KV pool (%d pages) cannot hold %d of the %d warm-up request groups: some eager "
                                "kernels may compile on first use", pool.num_pages, len(every) - len(groups),
                                len(every))
            report = warmup.warm_up(self.engine, groups, progress=progress or None)
            tensors = itertools.chain(self.model.parameters(), self.model.buffers())
            weights = sum({t.data_ptr(): t.numel() * t.element_size() for t in tensors}.values())
            kv = pool.bytes_per_page() * pool.num_pages
            if first is not None:  # the activations were measured on the profiling engine
                report.activation_bytes = first.activation_bytes
            self.startup = dict(load_s=loaded - start, ready_s=time.perf_counter() - start, graphs=report.graphs,
                                graph_bytes=report.graph_bytes, activation_bytes=report.activation_bytes,
                                reserved_bytes=reserved, weight_bytes=weights, kv_bytes=kv, kv_pages=pool.num_pages)
            log.info("%s; memory: weights %.2f GiB, KV pool %.2f GiB (%d pages, %d tokens); ready in %.1f s "
                     "(load %.1f s)", report.line(), weights / GIB, kv / GIB, pool.num_pages,
                     pool.num_pages * page_size, self.startup["ready_s"], self.startup["load_s"])
            compile_guard.arm()
        if self._workers:
            self.engine = TPEngine(self.engine, self._channel)

    def _start_tensor_parallel(self, world: int, device, worker_kwargs: dict) -> None:
        """Rank 0 (this process, its shard loaded): spawn ranks 1..world-1 (each builds the same engine on its
        shard) and join the group."""
        if device.type == "cpu":  # the workers' thread count: the replicated ops then reduce in the same order
            torch.set_num_threads(_rank_threads(world))
        if launched_by_torchrun():  # the other ranks were started by torchrun and run worker_main
            if int(os.environ["WORLD_SIZE"]) != world:
                raise ValueError(f"tensor_parallel_size={world} but torchrun started {os.environ['WORLD_SIZE']} ranks")
            init_group(0, world, None, device.type, _symmetric_bytes(world, worker_kwargs))
            self._workers, self._channel = ["torchrun"], GlooChannel()
        else:
            self._init_file = tempfile.mktemp(prefix="specmla-tp-")
            workers = self._workers
            try:
                if not ShmChannel.available():
                    raise OSError("the shared-memory channel needs x86-64")
                self._channel = ShmChannel.create(world - 1, alive=lambda: all(p.is_alive() for p in workers))
            except OSError:  # not x86-64, or no room in /dev/shm: the gloo channel
                self._channel = GlooChannel()
            path = self._channel.path if isinstance(self._channel, ShmChannel) else None
            ctx = mp.get_context("spawn")
            try:
                for rank in range(1, world):
                    p = ctx.Process(target=worker_main, daemon=True,
                                    args=(rank, world, self._init_file, str(self.model_path), worker_kwargs, path))
                    p.start()
                    workers.append(p)
                threading.Thread(target=_watch_workers, args=(weakref.ref(self), list(workers)), daemon=True,
                                 name="specmla-tp-watch").start()
                init_group(0, world, self._init_file, device.type, _symmetric_bytes(world, worker_kwargs))
            except BaseException:  # the workers would wait for a rank 0 that is not coming
                self._stopping = True
                self._abandon_workers()
                raise
            if path is not None:  # every worker mapped the channel before joining the group
                self._channel.unlink()
        atexit.register(self.shutdown)

    def _workers_exited(self, workers: list) -> None:
        """A rank that dies leaves the others waiting in a collective forever: when a spawned worker exits before
        `shutdown`, stop the remaining workers and this process (a server's supervisor then sees it exit)."""
        if self._stopping:
            return
        for p in workers:
            p.join(timeout=0.5)  # the sentinel fires before is_alive() turns False
        dead = [(i + 1, p.exitcode) for i, p in enumerate(workers) if not p.is_alive()]
        log.error("tensor-parallel rank(s) %s exited (exit codes %s); stopping every rank",
                  [r for r, _ in dead], [c for _, c in dead])
        self._abandon_workers()
        os._exit(1)

    def _abandon_workers(self) -> None:
        """Kill the spawned workers without a stop message (they ignore SIGTERM, and one inside a collective would
        never read a stop; multiprocessing's exit handler would join them forever) and remove the files."""
        for p in self._workers:
            if p != "torchrun" and p.is_alive():
                p.kill()
        self._workers = []
        self._remove_files()

    def _remove_files(self) -> None:
        """The shared-memory channel's file (if still there) and the group's rendezvous file."""
        if isinstance(self._channel, ShmChannel):
            self._channel.unlink()
        if self._init_file is not None and os.path.exists(self._init_file):
            os.unlink(self._init_file)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (no-op otherwise). Afterwards nothing of the group holds this LLM: its
        weights, pool and graphs go with the last reference to it."""
        if not self._workers:
            return
        atexit.unregister(self.shutdown)
        self._stopping = True
        clean = isinstance(self.engine, TPEngine) and not self.engine.in_step
        if clean:
            try:
                self.engine.shutdown()
            except RuntimeError:  # a worker died without reading the stop (the shared-memory channel noticed)
                log.error("a tensor-parallel rank exited before the stop; stopping the others")
                clean = False
        if not clean:  # a half-built LLM, a step cut short, a dead rank: the others may sit in a collective
            self._abandon_workers()
            return
        self._release_graphs()
        destroy_group()  # before the joins: the workers leave the group through a barrier with this rank
        for p in self._workers:
            if p != "torchrun":
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        self._workers = []
        self._channel.close()
        self._remove_files()

    def _release_graphs(self) -> None:
        """Drop the CUDA graphs before the group goes: torch's destroy_process_group waits forever on NCCL work
        captured in graphs that are still alive (pytorch/pytorch#115388)."""
        warmup.release(self.engine)
        gc.collect()
        if self.kv_pool.device.type == "cuda":
            torch.cuda.synchronize(self.kv_pool.device)

    @property
    def kv_pool(self) -> KVPool:
        return self.engine.pool

    @staticmethod
    def _as_prompt_list(prompts) -> list:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int):
            return [list(prompts)]
        return list(prompts)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (strings or lists of token ids); outputs in prompt order."""
        prompts = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # a request that can never fit the KV pool comes back finished with finish_reason "error"
        seqs = [self.engine.add_request(p, sp, admit_unfittable=True) for p, sp in zip(prompts, params)]
        bar = tqdm(total=len(seqs), desc="generating", disable=not use_tqdm)
        done = 0
        while self.engine.has_unfinished():
            self.engine.step()
            now_done = sum(s.is_finished for s in seqs)
            bar.update(now_done - done)
            done = now_done
        bar.close()
        return [self.engine.output_of(s) for s in seqs]

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request as it grows; the final RequestOutput is `self.last_output`."""
        params = sampling_params or SamplingParams()
        seq = self.engine.add_request(prompt, params)
        holdback = max((len(s) for s in params.stop), default=1) - 1  # a stop string may be forming
        emitted = 0
        while not seq.is_finished:
            self.engine.step()
            safe = len(seq.text) - (0 if seq.is_finished else holdback)
            if safe > emitted:
                yield seq.text[emitted:safe]
                emitted = safe
        if len(seq.text) > emitted:
            yield seq.text[emitted:]
        self.last_output = self.engine.output_of(seq)


def _symmetric_bytes(world: int, llm_kwargs: dict) -> int:
    """The symmetric memory each rank maps for the layers' one-shot all-reduce (0: all-reduces go through NCCL)."""
    return symmetric_bytes(world) if llm_kwargs.get("custom_all_reduce", True) else 0


def _rank_threads(world: int) -> int:
    """CPU threads per tensor-parallel rank: the cores shared out (every rank the same count)."""
    return max(1, (os.cpu_count() or 2) // world)


def _exit_with_parent() -> None:
    """A spawned worker whose rank 0 is gone (killed, crashed) would wait in a collective forever: exit."""
    mp_connection.wait([mp.parent_process().sentinel])
    os._exit(1)


def _watch_workers(llm_ref: weakref.ref, workers: list) -> None:
    """Wait for a spawned worker to exit, then let the LLM react (`LLM._workers_exited`). The thread holds the LLM
    weakly: a stopped LLM, its weights and pool, can be freed while it waits."""
    mp_connection.wait([p.sentinel for p in workers])
    llm = llm_ref()
    if llm is not None:
        llm._workers_exited(workers)


def worker_main(rank: int, world: int, init_file: str | None, model_path: str, llm_kwargs: dict,
                channel_path: str | None = None) -> None:
    """A worker rank's process: join the group, build rank 0's engine on its own shard (a KV pool mirroring rank
    0's), then follow rank 0's request stream until it stops. init_file None: launched by torchrun (env://
    rendezvous). channel_path: rank 0's shared-memory `ShmChannel` (else the request stream comes over gloo)."""
    torch.set_num_threads(_rank_threads(world))
    if init_file is not None:  # spawned by rank 0: it alone decides when this rank ends (its stop, or its exit)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        threading.Thread(target=_exit_with_parent, daemon=True, name="specmla-tp-parent").start()
    device = llm_kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    channel = ShmChannel.attach(channel_path, world - 1, rank) if channel_path else GlooChannel()
    init_group(rank, world, init_file, device, _symmetric_bytes(world, llm_kwargs))
    if device != "cpu":
        llm_kwargs = dict(llm_kwargs, device=f"cuda:{local_rank(rank)}")
    llm = LLM(model_path, _tp_rank=rank, _tp_world=world, **llm_kwargs)
    follow_engine(llm.engine, channel)
    channel.close()
    llm._release_graphs()
    destroy_group()
