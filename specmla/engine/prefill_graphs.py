"""Prefill steps as CUDA graphs between the attention calls (piecewise, as vLLM and SGLang capture them).

A prefill forward is cut at each layer's attention: piece 0 is the embedding and layer 0's projections
(q, the normed latent, the roped k_pe, the cache write); piece l runs layer l-1's o_proj, residual norm
and MLP, then layer l's projections; the last piece ends with the final norm. Each piece depends only on
the step's token count, so it is captured once per padded size (a bucket; every bucket at warm-up) and
replayed; attention, whose work depends on the batch's lengths and cached prefixes, runs eagerly between the
pieces on the real rows. Padded rows take token 0 at position 0 and write their cache rows into the pool's scratch page.

The pieces read and write static buffers sized for the largest bucket (token ids, positions, slots, the
residual stream, q, the latent, k_pe, attention's output, the final hidden states), so graphs of every
bucket share them and one memory pool; the returned hidden states are a view of the static buffer,
valid until the next prefill step.
"""

from __future__ import annotations

import numpy as np
import torch

from specmla.engine import compile_guard
from specmla.engine.kv_pool import KVPool
from specmla.model.deepseek import DeepseekForCausalLM
from specmla.model.metadata import AttentionMetadata


def prefill_buckets(max_tokens: int) -> list[int]:
    """Padded token counts: 16, 32, 48, 64, then steps of at most a half (96, 128, 192, 256, 384, ...) up
    to max_tokens, which is the last (padding wastes at most a third of a step)."""
    sizes, n = [], 16
    while n < max_tokens:
        sizes.append(n)
        n = n + 16 if n < 64 else n + (n // 2 if n & (n - 1) == 0 else n // 3)
    return sizes + [max_tokens]


class PiecewisePrefill:
    """Captures and replays a model's prefill forward in pieces around attention (see the module doc)."""

    def __init__(self, model: DeepseekForCausalLM, pool: KVPool, max_tokens: int, use_graphs: bool = True):
        """use_graphs=False runs the pieces eagerly (CPU, tests): the same buffers and padding."""
        if pool.scratch_page is None:
            raise ValueError("PiecewisePrefill needs a KV pool with a scratch page")
        self.model, self.pool = model, pool
        self.sizes = prefill_buckets(max_tokens)
        cfg, dev = model.config, pool.device
        n = self.sizes[-1]
        dtype = next(model.parameters()).dtype
        H = model.model.layers[0].self_attn.num_heads
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.x = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self.q = torch.zeros(n, H, cfg.qk_head_dim, dtype=dtype, device=dev)
        self.c_kv = torch.zeros(n, cfg.kv_lora_rank, dtype=dtype, device=dev)
        self.k_pe = torch.zeros(n, cfg.qk_rope_head_dim, dtype=dtype, device=dev)
        self.o = torch.zeros(n, H, cfg.v_head_dim, dtype=dtype, device=dev)
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self.mtp_hidden = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)  # the MTP catch-up's input
        self.mtp_out = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self.use_graphs = use_graphs
        self._host = torch.zeros(3, n, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._copied: torch.cuda.Event | None = None
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.mtp_graphs: dict[tuple[int, int], list[torch.cuda.CUDAGraph]] = {}  # (MTP module, size) → 2 pieces
        self.mempool = torch.cuda.graph_pool_handle() if use_graphs else None

    def padded_size(self, tokens: int) -> int | None:
        return next((b for b in self.sizes if b >= tokens), None)

    def _piece(self, layer: int, b: int) -> None:
        """Piece `layer` at padded size b (static buffers in, static buffers out)."""
        model = self.model
        layers = model.model.layers
        if layer == 0:
            x = model.model.embed_tokens(self.ids[:b])
        else:
            prev = layers[layer - 1]
            x = prev.finish(prev.self_attn.output(self.o[:b]), self.x[:b])
        if layer == len(layers):
            self.hidden[:b].copy_(model.model.norm(x))
        else:
            self._project(layers[layer], x, b, self.pool.caches[layer])

    def _mtp_piece(self, k: int, piece: int, b: int) -> None:
        """MTP module k's catch-up at padded size b: piece 0 its input (the next tokens' embeddings and
        mtp_hidden) and projections, writing MTP cache layer k; piece 1 the rest of its layer into mtp_out."""
        model = self.model
        layer = model.mtp[k]
        if piece == 0:
            x = model.mtp_input(k, self.ids[:b], self.mtp_hidden[:b])
            self._project(layer, x, b, self.pool.caches[model.config.num_hidden_layers + k])
        else:
            self.mtp_out[:b].copy_(layer.finish(layer.self_attn.output(self.o[:b]), self.x[:b]))

    def _project(self, layer, x: torch.Tensor, b: int, cache: torch.Tensor) -> None:
        """The residual x and `layer`'s attention inputs (q, the latent, k_pe; written to `cache` at the static
        slots) into the static buffers."""
        meta = AttentionMetadata(positions=self.positions[:b], cu_seqlens_q=self.positions[:1],
                                 seq_lens=self.positions[:1], max_seqlen_q=b, max_seqlen_kv=b,
                                 slot_mapping=self.slots[:b], kv_format=self.pool.kv_format)
        q, c_kv, k_pe = layer.self_attn.project(layer.input_layernorm(x), meta, self.model.cos_sin, cache)
        self.x[:b].copy_(x)
        self.q[:b].copy_(q)
        self.c_kv[:b].copy_(c_kv)
        self.k_pe[:b].copy_(k_pe)

    @torch.inference_mode()
    def capture(self, b: int, mtp: bool = False) -> None:
        """Capture bucket b's pieces (once; nothing without graphs), and with `mtp` the MTP catch-up's two pieces
        (MTP module 0, the one the catch-up runs)."""
        if not self.use_graphs:
            return
        if b not in self.graphs:
            layers = self.model.model.layers
            self.graphs[b] = self._captured([lambda layer=layer: self._piece(layer, b)
                                             for layer in range(len(layers) + 1)], b)
        if mtp and (0, b) not in self.mtp_graphs:
            self.mtp_graphs[(0, b)] = self._captured([lambda piece=piece: self._mtp_piece(0, piece, b)
                                                      for piece in (0, 1)], b)

    def _captured(self, pieces, b: int) -> list[torch.cuda.CUDAGraph]:
        """One graph per piece (callables of no argument), in order, on padding rows of size b: each piece
        runs once eagerly first (compiles kernels, allocates the ops' scratch outside the capture)."""
        compile_guard.note(f"CUDA graph capture of the prefill pieces at {b} tokens")
        self._load([], [], [], b)
        torch.cuda.synchronize()
        graphs = []
        for piece in pieces:
            piece()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.mempool):
                piece()
            graphs.append(g)
        torch.cuda.synchronize()
        return graphs

    def _load(self, input_ids: list[int], positions: list[int], slots: list[int], b: int) -> None:
        """The step's rows into the static buffers (one copy from pinned memory), then padding up to b: token 0,
        position 0, the scratch page's slots."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the pinned buffer
        T, ps = len(input_ids), self.pool.page_size
        host = self._host.numpy()
        host[0, :T], host[1, :T], host[2, :T] = input_ids, positions, slots
        host[0, T:b] = 0
        host[1, T:b] = 0
        host[2, T:b] = self.pool.scratch_page * ps + np.arange(b - T) % ps
        nb = self.ids.is_cuda  # from pinned memory, asynchronously
        self.ids[:b].copy_(self._host[0, :b], non_blocking=nb)
        self.positions[:b].copy_(self._host[1, :b], non_blocking=nb)
        self.slots[:b].copy_(self._host[2, :b], non_blocking=nb)
        if nb:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _bucket(self, tokens: int) -> int:
        b = self.padded_size(tokens)
        if b is None:
            raise ValueError(f"{tokens} tokens exceed the largest prefill graph ({self.sizes[-1]})")
        return b

    @torch.inference_mode()
    def forward(self, input_ids: list[int], positions: list[int], slots: list[int],
                meta: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of a prefill step whose rows are (input_ids, positions,
        slots) and whose attention metadata (built on the real rows) is `meta`; T must fit a bucket."""
        T = len(input_ids)
        b = self._bucket(T)
        layers = self.model.model.layers
        pieces = [lambda layer=layer: self._piece(layer, b) for layer in range(len(layers) + 1)]
        self.capture(b)
        run = [g.replay for g in self.graphs[b]] if self.use_graphs else pieces
        self._load(input_ids, positions, slots, b)
        for layer, lay in enumerate(layers):
            run[layer]()
            self.o[:T].copy_(lay.self_attn.attend(self.q[:T], self.c_kv[:T], self.k_pe[:T], meta,
                                                  self.pool.caches[layer]))
        run[-1]()
        return self.hidden[:T]

    @torch.inference_mode()
    def mtp_forward(self, k: int, next_ids: list[int], prev_hidden: torch.Tensor, positions: list[int],
                    slots: list[int], meta: AttentionMetadata) -> torch.Tensor:
        """`DeepseekForCausalLM.mtp_forward` of MTP module k over T rows (the MTP catch-up after a prefill
        step): the next tokens, the trunk's hidden rows [T, hidden], their positions and slots (in MTP cache
        layer k), attention metadata on the real rows. Returns a view [T, hidden] of a static buffer."""
        T = len(next_ids)
        b = self._bucket(T)
        pieces = [lambda piece=piece: self._mtp_piece(k, piece, b) for piece in (0, 1)]
        if self.use_graphs and (k, b) not in self.mtp_graphs:  # (module 0 is captured at warm-up)
            self.mtp_graphs[(k, b)] = self._captured(pieces, b)
        run = [g.replay for g in self.mtp_graphs[(k, b)]] if self.use_graphs else pieces
        self._load(next_ids, positions, slots, b)
        self.mtp_hidden[:T].copy_(prev_hidden)
        layer = self.model.mtp[k]
        cache = self.pool.caches[self.model.config.num_hidden_layers + k]
        run[0]()
        self.o[:T].copy_(layer.self_attn.attend(self.q[:T], self.c_kv[:T], self.k_pe[:T], meta, cache))
        run[1]()
        return self.mtp_out[:T]
