"""DeepSeek-V2/V3-family model in plain PyTorch (the reference path; kernels plug in through `ops`).

Parameter names follow the HF checkpoints (`model.layers.{i}.self_attn.kv_b_proj.weight`, ...), so
loading is a name-for-name copy. The MTP modules live under `mtp.{i}` here and under
`model.layers.{num_hidden_layers + i}` in checkpoints (the loader maps one to the other); their
embedding and head are the trunk's tensors, not copies.

Inputs are ragged: tokens of all requests packed into one [T] axis, described by an
`AttentionMetadata`. Attention runs in one of two mathematically equal forms:
- naive / MHA (prefill): up-project the latent c_kv with kv_b_proj into per-head k_nope and v;
- absorbed (decode): fold W_UK into q (q_nope · W_UK → Dc wide), attend over the latent cache
  directly with `ops.mla_decode`, then apply W_UV to the Dc-wide output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmla.config import ModelConfig
from specmla.model.tp_reduce import tp_all_reduce_
from specmla.model.metadata import AttentionMetadata
from specmla.model.rope import rope_cos_sin_cache
from specmla.ops.decode import mla_decode
from specmla.ops.decode_prologue import mla_decode_prologue
from specmla.ops.kv_cache import decode_rows, write_kv_cache
from specmla.ops.kv_cache.rotation import rotate_rows_torch
from specmla.ops.linear import fp8_block_linear, head_matmul, linear
from specmla.ops.linear.reference import BLOCK as FP8_BLOCK
from specmla.ops.moe import RouteSpec, fused_moe, moe_route, moe_route_torch
from specmla.ops.norm import rms_norm, rms_norm_pair
from specmla.ops.prefill import mla_prefill, prefill_schedule
from specmla.ops.rope import apply_rope, apply_rope_qk_


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)[0]


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    tp_reduce = False  # set when tensor parallelism splits this MLP (its output is a partial sum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return tp_all_reduce_(out) if self.tp_reduce else out


class Router(nn.Module):
    """Top-k expert choice for V3 (sigmoid + e_score_correction_bias, group top-2 sums) and V2
    (softmax; greedy or group-limited greedy by the group's best expert)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size))
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        self.spec = RouteSpec.from_config(cfg)

    def forward(self, x: torch.Tensor, id_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [T, k], expert ids [T, k] minus id_offset); one Triton kernel on CUDA at inference."""
        if torch.is_grad_enabled():  # training needs the torch ops' gradients
            return moe_route_torch(x, self.weight, self.e_score_correction_bias, self.spec, id_offset=id_offset)
        return moe_route(x, self.weight, self.e_score_correction_bias, self.spec, id_offset=id_offset)


class MoE(nn.Module):
    """Routed experts stacked ([E, 2I, H] gate‖up, transformers' fused layout, and [E, H, I] down) and the
    shared experts fused the same way ([2·Is, H] gate‖up, [H, Is] down); the checkpoint's per-expert and
    shared-expert tensors are views into them. One path for every batch: `ops.moe_route`, then
    `ops.fused_moe` (Triton on CUDA, its torch reference on CPU or with gradients).

    FP8 checkpoints (`use_fp8_`): the stacks hold float8_e4m3fn with fp32 scales per 128 × 128 block, each
    expert's (and the shared experts') intermediate width padded to a multiple of 128 with zero rows and columns,
    so that gate and up each start a scale block and the fused kernels see whole groups.

    Expert parallelism (`model.sharding`) keeps only this rank's experts [e0, e1) and its column slice of
    the shared experts; ids are shifted by e0, so other ranks' experts fall outside [0, E_local) and add
    nothing, and one all-reduce sums the ranks' partial outputs.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate = Router(cfg)
        self.inter = I  # the checkpoint's width; `inter_padded` the stacks' (a multiple of 128 for fp8)
        self.inter_padded = I
        self.shared_inter = I * (cfg.n_shared_experts or 0)
        self.w_gate_up = nn.Parameter(torch.empty(E, 2 * I, H))
        self.w_down = nn.Parameter(torch.empty(E, H, I))
        Is = self.shared_inter
        self.shared_gate_up = nn.Parameter(torch.empty(2 * Is, H)) if Is else None
        self.shared_down = nn.Parameter(torch.empty(H, Is)) if Is else None
        self.w_gate_up_scale = self.w_down_scale = None
        self.shared_gate_up_scale = self.shared_down_scale = None

    tp_reduce = False
    local_experts: tuple[int, int] | None = None  # expert parallelism: the global ids [e0, e1) held here
    backend = "auto"  # `ops.fused_moe`'s backend (fp8 stacks: "w8a8_torch" under `model.fp8.use_fp8_numerics_`)

    def use_fp8_(self) -> None:
        """Replace the stacks by float8_e4m3fn ones with fp32 scales per FP8_BLOCK × FP8_BLOCK block
        (uninitialised, on the stacks' device; the loader fills them, `zero_padding_` clears the padding)."""
        block = FP8_BLOCK
        E, H = self.w_down.shape[:2]
        cdiv = lambda a: -(-a // block)  # noqa: E731
        dev = self.w_down.device
        Ip = cdiv(self.inter) * block
        self.inter_padded = Ip

        def fp8(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=torch.float8_e4m3fn, device=dev), requires_grad=False)

        def scale(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=torch.float32, device=dev), requires_grad=False)

        self.w_gate_up, self.w_gate_up_scale = fp8(E, 2 * Ip, H), scale(E, 2 * Ip // block, cdiv(H))
        self.w_down, self.w_down_scale = fp8(E, H, Ip), scale(E, cdiv(H), Ip // block)
        if self.shared_down is not None:
            Isp = cdiv(self.shared_inter) * block
            self.shared_gate_up, self.shared_gate_up_scale = fp8(2 * Isp, H), scale(2 * Isp // block, cdiv(H))
            self.shared_down, self.shared_down_scale = fp8(H, Isp), scale(cdiv(H), Isp // block)

    def zero_padding_(self) -> None:
        """Zero the fp8 stacks' padding rows and columns (past each expert's width), which no checkpoint tensor
        covers: silu(0)·0 = 0 keeps them out of the sum."""
        I, Ip = self.inter, self.inter_padded
        if Ip == I:
            return
        with torch.no_grad():
            self.w_gate_up.view(-1, 2, Ip, self.w_gate_up.shape[-1])[:, :, I:].view(torch.uint8).zero_()
            self.w_down[..., I:].view(torch.uint8).zero_()
            if self.shared_down is not None:
                Is, Isp = self.shared_inter, self.shared_down.shape[1]
                self.shared_gate_up.view(2, Isp, -1)[:, Is:].view(torch.uint8).zero_()
                self.shared_down[:, Is:].view(torch.uint8).zero_()

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint names (relative to this module) → views of the stacked tensors (and of their block scales:
        `<name>_scale_inv`)."""
        out, I, Ip = {}, self.inter, self.inter_padded
        e0 = self.local_experts[0] if self.local_experts is not None else 0  # global id of local expert 0
        fp8 = self.w_gate_up_scale is not None
        nb = -(-Ip // FP8_BLOCK)  # scale rows of one projection (fp8: Ip is a multiple of FP8_BLOCK)
        for e in range(self.w_down.shape[0]):
            pre = f"experts.{e0 + e}."
            out[pre + "gate_proj.weight"] = self.w_gate_up[e, :I]
            out[pre + "up_proj.weight"] = self.w_gate_up[e, Ip:Ip + I]
            out[pre + "down_proj.weight"] = self.w_down[e, :, :I]
            if fp8:
                out[pre + "gate_proj.weight_scale_inv"] = self.w_gate_up_scale[e, :nb]
                out[pre + "up_proj.weight_scale_inv"] = self.w_gate_up_scale[e, nb:]
                out[pre + "down_proj.weight_scale_inv"] = self.w_down_scale[e]
        if self.shared_down is not None:
            Is, Isp = self.shared_inter, self.shared_down.shape[1]
            out["shared_experts.gate_proj.weight"] = self.shared_gate_up[:Is]
            out["shared_experts.up_proj.weight"] = self.shared_gate_up[Isp:Isp + Is]
            out["shared_experts.down_proj.weight"] = self.shared_down[:, :Is]
            if fp8:
                nbs = Isp // FP8_BLOCK
                out["shared_experts.gate_proj.weight_scale_inv"] = self.shared_gate_up_scale[:nbs]
                out["shared_experts.up_proj.weight_scale_inv"] = self.shared_gate_up_scale[nbs:]
                out["shared_experts.down_proj.weight_scale_inv"] = self.shared_down_scale
        return out

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' output for x [T, hidden], plus `residual` where given (added in the kernel's fp32 sum
        without tensor parallelism, after the all-reduce with it)."""
        # expert parallelism: ids relative to this rank's first expert (the others fall outside its stack)
        weights, idx = self.gate(x, 0 if self.local_experts is None else self.local_experts[0])
        shared = None if self.shared_down is None else (self.shared_gate_up, self.shared_down)
        shared_scales = None if self.shared_down_scale is None else (self.shared_gate_up_scale,
                                                                     self.shared_down_scale)
        # the kernel's sum takes the residual where it has x's dtype and no all-reduce follows
        fused = residual is not None and not self.tp_reduce and residual.dtype == x.dtype
        out = fused_moe(x, self.w_gate_up, self.w_down, weights, idx, shared=shared,
                        w_gate_up_scale=self.w_gate_up_scale, w_down_scale=self.w_down_scale,
                        shared_scales=shared_scales, residual=residual if fused else None, backend=self.backend)
        if self.tp_reduce:
            out = tp_all_reduce_(out)
        return out if residual is None or fused else out + residual


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, hid = cfg.num_attention_heads, cfg.hidden_size
        self.num_heads = H
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hid, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hid, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hid, cfg.latent_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, hid, bias=cfg.attention_bias)

    def fuse_input_projections_(self) -> bool:
        """One GEMM for the two projections of the layer's input at inference: q_proj (q_a_proj with a q LoRA) and
        kv_a_proj_with_mqa concatenated by rows into the buffer `input_proj_weight` (FP8: with its block scales in
        `input_proj_scale`); both modules' weights become views of it, so loading into or editing them edits it
        (moving the model to another device after this breaks the sharing: fuse on the final device). False,
        nothing changed, where the two differ in dtype, either has a bias, or an FP8 first part does not end on a
        scale block."""
        first = self.q_proj if self.cfg.q_lora_rank is None else self.q_a_proj
        second = self.kv_a_proj_with_mqa
        fp8 = first.weight.dtype == torch.float8_e4m3fn
        if (first.weight.dtype != second.weight.dtype or first.bias is not None or second.bias is not None
                or fp8 and first.weight.shape[0] % FP8_BLOCK):
            return False
        n = first.weight.shape[0]
        parts = [("weight", "input_proj_weight")] + ([("weight_scale_inv", "input_proj_scale")] if fp8 else [])
        for attr, buffer in parts:
            a, b = getattr(first, attr), getattr(second, attr)
            fused = torch.cat([a.detach(), b.detach()])
            rows = n if attr == "weight" else n // FP8_BLOCK
            a.data, b.data = fused[:rows], fused[rows:]  # the same parameters, their storage the fused one's
            self.register_buffer(buffer, fused, persistent=False)
        return True

    def _input_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_proj(x) or q_a_proj(x), kv_a_proj_with_mqa(x)): one GEMM where `fuse_input_projections_` made the
        fused weight and no gradient is wanted, else the two modules (FP8: the fused GEMM runs on the first
        module's `Fp8Linear.backend`)."""
        first = self.q_proj if self.cfg.q_lora_rank is None else self.q_a_proj
        fused = getattr(self, "input_proj_weight", None)
        if fused is None or torch.is_grad_enabled():
            return first(x), self.kv_a_proj_with_mqa(x)
        scale = getattr(self, "input_proj_scale", None)
        y = linear(x, fused) if scale is None else fp8_block_linear(x, fused, scale, backend=first.backend)
        return y.split([first.weight.shape[0], self.kv_a_proj_with_mqa.weight.shape[0]], dim=-1)

    # W_UK [H, Dn, Dc] and W_UV [H, Dv, Dc]: views into kv_b_proj.weight (no copies), or (rotated) into its copy
    # with tbq4's rotation folded in along Dc (`fold_tbq4_rotation_`).
    def absorbed_weights(self, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        w = self.kv_b_rotated if rotated else self.kv_b_proj.weight
        w = w.view(self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    def fold_tbq4_rotation_(self) -> None:
        """For a tbq4 cache: keep kv_b_proj's weight times tbq4's rotation R along Dc (a buffer, not a checkpoint
        tensor). The absorbed decode then makes q's latent part already rotated (q_nope · W_UK·R) and takes the
        output from the rotated domain (o · (W_UV·R)ᵀ, R being its own inverse), so `mla_decode` runs with
        rotated=True and launches no rotation. Costs one more copy of kv_b_proj; a snapshot of its weight (call
        again after changing it)."""
        w = self.kv_b_proj.weight.detach()
        self.register_buffer("kv_b_rotated", rotate_rows_torch(w, w.shape[-1]), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor | None,
        force_naive: bool = False,
    ) -> torch.Tensor:
        if meta.decode_query_len and kv_cache is not None and not force_naive and not torch.is_grad_enabled():
            return self.output(self._decode(x, meta, cos_sin, kv_cache))
        q, c_kv, k_pe = self.project(x, meta, cos_sin, kv_cache)
        return self.output(self.attend(q, c_kv, k_pe, meta, kv_cache, force_naive))

    def _decode(self, x: torch.Tensor, meta: AttentionMetadata, cos_sin: torch.Tensor,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """The absorbed decode at inference, `project` + `attend` in fewer launches: the latent's norm, both ropes,
        the cache write and q_pe's place in the absorbed query are one kernel (`mla_decode_prologue`), and
        q_nope · W_UK is written beside it (no cat). Returns o [T, H, v_head_dim]."""
        cfg, H = self.cfg, self.num_heads
        T, Dn, Dc = x.shape[0], cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q, latent = self._input_projections(x)
        if cfg.q_lora_rank is not None:
            q = self._linear(self.q_b_proj, self.q_a_layernorm(q))
        q = q.view(T, H, cfg.qk_head_dim)
        q_abs = torch.empty(T, H, cfg.latent_dim, dtype=q.dtype, device=q.device)
        norm = self.kv_a_layernorm
        mla_decode_prologue(q, latent, norm.weight, norm.eps, meta.positions, cos_sin, kv_cache, meta.slot_mapping,
                            q_abs, kv_format=meta.kv_format, interleave=cfg.rope_interleave)
        rotated = meta.kv_format == "tbq4" and hasattr(self, "kv_b_rotated")
        w_uk, w_uv = self.absorbed_weights(rotated)
        head_matmul(q[..., :Dn], w_uk, out=q_abs[..., :Dc])
        o_lat = mla_decode(
            q_abs.view(-1, meta.decode_query_len, H, cfg.latent_dim), kv_cache, meta.block_table, meta.seq_lens,
            cfg.softmax_scale, causal=True, head_dim_v=Dc, kv_format=meta.kv_format, rotated=rotated,
        )  # [B, S, H, Dc]
        return head_matmul(o_lat.view(T, H, Dc), w_uv.transpose(1, 2))

    @staticmethod
    def _linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """module(x), through `ops.linear.linear` (decode-sized 16-bit GEMVs) where it is a plain nn.Linear."""
        if type(module) is nn.Linear:
            return linear(x, module.weight, module.bias)
        return module(x)

    def project(self, x: torch.Tensor, meta: AttentionMetadata, cos_sin: torch.Tensor,
                kv_cache: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The per-token part before attention: q [T, H, qk_head_dim] (rope applied to its last
        qk_rope_head_dim columns), the normed latent c_kv [T, kv_lora_rank] and the roped k_pe
        [T, qk_rope_head_dim], written to the cache at meta.slot_mapping. Reads only meta.positions,
        meta.slot_mapping and meta.kv_format, so it depends on the token count alone."""
        cfg, H = self.cfg, self.num_heads
        T = x.shape[0]
        q, latent = self._input_projections(x)
        if cfg.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(T, H, cfg.qk_head_dim)
        q_pe = q[..., cfg.qk_nope_head_dim:]
        c_kv, k_pe = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        if torch.is_grad_enabled():  # training: out of place, so autograd sees it
            q = torch.cat([q[..., : cfg.qk_nope_head_dim],
                           apply_rope(q_pe, meta.positions, cos_sin, cfg.rope_interleave)], dim=-1)
            k_pe = apply_rope(k_pe, meta.positions, cos_sin, cfg.rope_interleave)
        else:  # inference: in place on the views of q / the latent (one Triton kernel each on CUDA)
            apply_rope_qk_(q_pe, k_pe, meta.positions, cos_sin, cfg.rope_interleave)
        if kv_cache is not None:
            write_kv_cache(kv_cache, c_kv, k_pe, meta.slot_mapping, meta.kv_format)
        return q, c_kv, k_pe

    def attend(self, q: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, meta: AttentionMetadata,
               kv_cache: torch.Tensor | None, force_naive: bool = False) -> torch.Tensor:
        """Attention of `project`'s outputs: o [T, H, v_head_dim]."""
        q_nope, q_pe = q.split([self.cfg.qk_nope_head_dim, self.cfg.qk_rope_head_dim], dim=-1)
        if meta.decode_query_len and kv_cache is not None and not force_naive:
            return self._absorbed(q_nope, q_pe, meta, kv_cache)
        return self._naive(q, c_kv, k_pe, meta, kv_cache)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o_proj of attention's output [T, H, v_head_dim] (all-reduced under tensor parallelism)."""
        out = self._linear(self.o_proj, o.reshape(o.shape[0], -1))
        return tp_all_reduce_(out) if getattr(self, "tp_reduce", False) else out

    def _naive(self, qf, c_kv, k_pe, meta, kv_cache):
        cfg, H = self.cfg, self.num_heads
        if meta.context_slots is not None:  # context = cached prefix + this step's tokens
            rows = kv_cache.view(-1, kv_cache.shape[-1])[meta.context_slots]
            latent = decode_rows(meta.kv_format, rows, cfg.kv_lora_rank, cfg.qk_rope_head_dim, c_kv.dtype)
            c_kv, k_pe = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
            cu_kv = meta.cu_seqlens_kv
        else:
            cu_kv = meta.cu_seqlens_q
        kv = self.kv_b_proj(c_kv).view(-1, H, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, H, -1)], dim=-1)
        if meta.uniform_len and meta.context_slots is None and torch.is_grad_enabled():
            return _batched_causal_sdpa(qf, k, v, meta.uniform_len, cfg.softmax_scale)
        if qf.is_cuda:
            v = v.contiguous()  # heads packed in rows (stride H·Dv), as the Hopper kernel's TMA reads them
            if meta.cu_seqlens_q.shape[0] > 2 and meta.prefill_schedule is None:  # once for all layers
                meta.prefill_schedule = prefill_schedule(meta.cu_seqlens_q, cu_kv, qf.shape[0])
        return mla_prefill(
            qf, k, v, meta.cu_seqlens_q, cu_kv, meta.max_seqlen_q, meta.max_seqlen_kv, cfg.softmax_scale, causal=True,
            schedule=meta.prefill_schedule,
        )

    def _absorbed(self, q_nope, q_pe, meta, kv_cache):
        cfg, H = self.cfg, self.num_heads
        rotated = meta.kv_format == "tbq4" and hasattr(self, "kv_b_rotated")
        w_uk, w_uv = self.absorbed_weights(rotated)
        q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)  # [T, H, Dc]
        S = meta.decode_query_len
        q = torch.cat([q_lat, q_pe], dim=-1).view(-1, S, H, cfg.latent_dim)
        o_lat = mla_decode(
            q, kv_cache, meta.block_table, meta.seq_lens, cfg.softmax_scale, causal=True,
            head_dim_v=cfg.kv_lora_rank, kv_format=meta.kv_format, rotated=rotated,
        )  # [B, S, H, Dc]
        return torch.einsum("thc,hvc->thv", o_lat.reshape(-1, H, cfg.kv_lora_rank), w_uv)


def _batched_causal_sdpa(q, k, v, L, scale):
    """Training: equal-length sequences as one [B, H, L, D] causal SDPA (flash / memory-efficient
    kernels with a backward) instead of the per-request reference loop."""
    T, H = q.shape[:2]
    to_bhld = lambda t: t.view(T // L, L, H, t.shape[-1]).transpose(1, 2)  # noqa: E731
    o = F.scaled_dot_product_attention(to_bhld(q), to_bhld(k), to_bhld(v), is_causal=True, scale=scale)
    return o.transpose(1, 2).reshape(T, H, v.shape[-1])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MLAttention(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, meta, cos_sin, kv_cache, force_naive=False):
        return self.finish(self.self_attn(self.input_layernorm(x), meta, cos_sin, kv_cache, force_naive), x)

    def finish(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The layer after attention: attention's projected output h added to the residual x, normed, MLP."""
        post = self.post_attention_layernorm
        normed, x = rms_norm(h, post.weight, post.eps, residual=x)  # residual add fused into the norm
        if isinstance(self.mlp, MoE):
            return self.mlp(normed, residual=x)  # added in the experts' sum
        return x + self.mlp(normed)


class SharedHead(nn.Module):
    """The MTP head's own final norm; the projection is the trunk's lm_head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3 multi-token prediction module: h' = layer(eh_proj([enorm(emb(t_{i+1})) ; hnorm(h_i)]))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def checkpoint_name(name: str, num_hidden_layers: int) -> str:
    """A parameter's name in HF checkpoints (MTP module k is checkpoint layer num_hidden_layers + k)."""
    if name.startswith("mtp."):
        k, rest = name[4:].split(".", 1)
        return f"model.layers.{num_hidden_layers + int(k)}.{rest}"
    return name


class DeepseekForCausalLM(nn.Module):
    """Trunk + head + MTP modules. `forward` returns final-normed hidden states [T, hidden]."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.model = DeepseekModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        n = cfg.num_hidden_layers
        self.mtp = nn.ModuleList(MTPLayer(cfg, n + i) for i in range(cfg.num_nextn_predict_layers))
        self.max_positions = max_positions or cfg.max_position_embeddings
        self.register_buffer(
            "cos_sin", rope_cos_sin_cache(cfg.rope, cfg.qk_rope_head_dim, self.max_positions), persistent=False
        )

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """HF checkpoint name → the tensor (or view) that holds it. MTP module k is checkpoint layer
        num_hidden_layers + k; its embedding/head are the trunk's and are not listed again."""
        n = self.config.num_hidden_layers
        out: dict[str, torch.Tensor] = {}
        stacked = {"w_gate_up", "w_down", "shared_gate_up", "shared_down", "w_gate_up_scale", "w_down_scale",
                   "shared_gate_up_scale", "shared_down_scale"}  # listed by MoE.checkpoint_tensors
        for name, t in list(self.named_parameters()) + [
            (b, t) for b, t in self.named_buffers() if b.endswith("e_score_correction_bias")
        ]:
            if name.rsplit(".", 1)[-1] in stacked:
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            out[checkpoint_name(name, n)] = t
        for name, module in self.named_modules():
            if isinstance(module, MoE):
                for rel, t in module.checkpoint_tensors().items():
                    out[checkpoint_name(f"{name}.{rel}", n)] = t
        return out

    def fuse_input_projections_(self) -> int:
        """Every attention layer (trunk and MTP) fuses the two projections of its input into one GEMM
        (`MLAttention.fuse_input_projections_`); returns how many did."""
        return sum(layer.self_attn.fuse_input_projections_() for layer in list(self.model.layers) + list(self.mtp))

    def fold_tbq4_rotation_(self) -> None:
        """Every attention layer (trunk and MTP) folds tbq4's rotation into a copy of its kv_b_proj
        (`MLAttention.fold_tbq4_rotation_`): decode over a tbq4 cache then launches no rotation."""
        for layer in list(self.model.layers) + list(self.mtp):
            layer.self_attn.fold_tbq4_rotation_()

    @property
    def num_cache_layers(self) -> int:
        """Trunk layers followed by the MTP layers: one paged latent cache each."""
        return self.config.num_hidden_layers + len(self.mtp)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor] | None = None,
        force_naive: bool = False,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, meta, self.cos_sin, kv_caches[i] if kv_caches is not None else None, force_naive)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def mtp_forward(
        self,
        k: int,
        next_ids: torch.Tensor,
        prev_hidden: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """MTP module k (applied recursively by the proposer): row i combines the token at i+1 with
        the hidden state of position i (the trunk's final-normed state, or the previous MTP output),
        at i's rope position. Returns the pre-norm hidden state; `mtp_logits` applies the head."""
        cache = kv_caches[self.config.num_hidden_layers + k] if kv_caches is not None else None
        return self.mtp[k](self.mtp_input(k, next_ids, prev_hidden), meta, self.cos_sin, cache)

    def mtp_input(self, k: int, next_ids: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """MTP module k's layer input: eh_proj([enorm(emb(next_ids)) ; hnorm(prev_hidden)])."""
        layer = self.mtp[k]
        e = self.model.embed_tokens(next_ids)
        return layer.eh_proj(rms_norm_pair(e, prev_hidden, layer.enorm.weight, layer.hnorm.weight, layer.enorm.eps))

    def mtp_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.mtp[k].shared_head.norm(hidden)).float()

    # Greedy token ids straight from the head's output: the fp32 cast of `compute_logits` is exact,
    # so the argmax is the same, one kernel fewer per call (it counts in a B=1 graph).
    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).argmax(-1)

    def mtp_greedy_tokens(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.mtp[k].shared_head.norm(hidden)).argmax(-1)
