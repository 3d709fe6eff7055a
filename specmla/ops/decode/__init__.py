"""MLA decode attention over a paged latent cache (contract C1).

q [B, S, H, Dc+Dr] is the absorbed query (q_nope·W_UK ‖ roped q_pe); every head attends to the same cached
latent rows [c_kv | k_pe], and the values are the c_kv part. `mla_decode` checks the arguments, asks
`dispatch.select_kernel` for a kernel and plan, runs it (stage 1: split-KV partials, or the output itself
with one split) and merges the splits (stage 2). Kernels: `triton.py` (portable) and `hopper/` (Gluon).
"""

from __future__ import annotations

import importlib

import torch

from specmla.ops import tuned
from specmla.ops.decode import dispatch
from specmla.ops.decode.hopper import common as hopper_common
from specmla.ops.decode.reference import check_args, mla_decode_torch
from specmla.ops.decode.triton import LOG2E, combine_splits
from specmla.ops.kv_cache.rotation import combine_rotate, rotate_rows, rotate_rows_torch

__all__ = ["mla_decode", "mla_decode_torch"]

def _module_name(kernel: str) -> str:
    return f"{__name__}.{kernel}" if kernel == "triton" else f"{__name__}.hopper.{kernel}"


def kernel_module(name: str):
    """The module of a decode kernel (one of `dispatch.KERNELS`)."""
    return importlib.import_module(_module_name(name))


def _kernel_of(opts) -> str:
    for name in dispatch.KERNELS:
        if type(opts).__module__ == _module_name(name):
            return name
    raise TypeError(f"opts must be the Options of a decode kernel module, got {type(opts).__name__}")


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def _routes(device: torch.device) -> dict:
    """The device's measured routes (`dispatch.load_routes`; none off CUDA)."""
    return dispatch.load_routes(tuned.cuda_device_key(device))


def route(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, *, kv_format: str = "bf16",
          head_dim_v: int | None = None, backend: str = "auto", opts=None) -> dispatch.Route:
    """The kernel and plan `mla_decode` takes for these tensors (see `dispatch.select_kernel`)."""
    B, S, H, D = q.shape
    dc = D - 64 if head_dim_v is None else head_dim_v
    kernel = None if opts is None else _kernel_of(opts)
    topts = opts if kernel == "triton" else None
    hopper = backend != "triton" and hopper_common.on_hopper(q)

    def supports(name: str, block_m: int) -> bool:
        module = kernel_module(name)
        chosen = opts if kernel == name else module.Options()
        return module.supported(q, kv_cache, kv_format, block_m, chosen, head_dim_v=dc)

    # the table's width grows with the longest request in eager steps; a power-of-two bucket keeps the split
    # count (and the compiled combine) stable instead of changing every few pages
    max_seq = dispatch.next_power_of_2(block_table.shape[1]) * kv_cache.shape[1]
    block_n = topts.block_n if topts else getattr(opts, "block_n", None)
    return dispatch.select_kernel(
        B, S, H, D, kv_format, hopper=hopper, sm_count=_sm_count(q.device), max_seq=max_seq,
        elem=max(q.element_size(), kv_cache.element_size()), supports=supports, backend=backend, kernel=kernel,
        block_n=block_n, max_rows=topts.max_rows if topts else dispatch.MAX_ROWS, routes=_routes(q.device))


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    *,
    causal: bool = True,
    kv_format: str = "bf16",
    kv_scale=None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    head_dim_v: int | None = None,
    opts=None,
    num_splits: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    rotated: bool = False,
):
    """Contract C1. Returns out [B, S, H, Dc] (q's dtype) and, if return_lse, lse [B, S, H] fp32.

    `head_dim_v` (Dc, the value width) defaults to D - 64 (DeepSeek's 512 + 64 layout). backend: "auto" (the
    route table of `dispatch` on CUDA, the torch reference on CPU), "torch", "triton" (the portable kernel; also
    under TRITON_INTERPRET=1 on CPU tensors) or "hopper" (a Gluon kernel, ValueError where none takes the call).
    `opts`: the `Options` of one kernel module, which then runs the call. `num_splits` overrides the planned
    split count; `workspace` = (mid_o [B, S, H, splits, Dc], mid_lse [B, S, H, splits]) fp32, preallocated (its
    split count wins). kv_format "fp8" / "fp8_ds_mla" / "tbq4": uint8 rows of `ops.kv_cache`'s layouts.
    `rotated` (tbq4 only): q's latent part comes in tbq4's rotated domain and out is returned in it, for a caller
    that folds the rotation into its weights (the model's W_UK and W_UV); the call then launches no rotation.
    """
    if rotated and kv_format != "tbq4":
        raise ValueError(f"rotated=True is for tbq4 caches (attention in the rotated domain); got {kv_format!r}")
    if backend not in ("auto", "torch", "triton", "hopper"):
        raise ValueError(f"unknown backend {backend!r} (auto | torch | triton | hopper)")
    if backend == "auto" and opts is None and not q.is_cuda:
        backend = "torch"
    if backend == "torch":
        dc = q.shape[-1] - 64 if head_dim_v is None else head_dim_v
        if rotated:  # the reference attends in the original domain: q back (the rotation is its own inverse)
            q = rotate_rows_torch(q, dc)
        res = mla_decode_torch(
            q, kv_cache, block_table, seq_lens, softmax_scale, causal=causal, kv_format=kv_format,
            kv_scale=kv_scale, out=out, return_lse=return_lse, head_dim_v=head_dim_v,
        )
        if rotated:
            o = res[0] if return_lse else res
            rotate_rows_torch(o, dc, out=o)
        return res
    head_dim_v = q.shape[-1] - 64 if head_dim_v is None else head_dim_v
    check_args(q, kv_cache, block_table, seq_lens, head_dim_v, kv_format)
    if head_dim_v % 16 or (q.shape[-1] - head_dim_v) % 16:
        raise ValueError(f"Dc={head_dim_v} and Dr={q.shape[-1] - head_dim_v} must be multiples of 16")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache must be contiguous in their last dimension")
    chosen = route(q, kv_cache, block_table, kv_format=kv_format, head_dim_v=head_dim_v, backend=backend, opts=opts)
    module = kernel_module(chosen.kernel)
    kernel_opts = opts if opts is not None else module.Options()
    plan = dict(chosen.plan)
    B, S, H, _ = q.shape
    dc = head_dim_v
    ns = num_splits or plan["num_splits"]
    if workspace is not None:
        mid_o, mid_lse = workspace
        ns = mid_o.shape[3]
    plan["num_splits"] = ns
    if out is None:
        out = torch.empty(B, S, H, dc, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, S, H, dtype=torch.float32, device=q.device)
    direct = ns == 1  # stage 1 writes the result itself: no workspace, no combine
    if direct:
        mid_o, mid_lse = out, lse
    elif workspace is None:
        mid_o = torch.empty(B, S, H, ns, dc, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(B, S, H, ns, dtype=torch.float32, device=q.device)
    tbq = kv_format == "tbq4" and not rotated
    if tbq:  # attention runs in the rotated domain: q's latent part rotated once, the output back once
        q = rotate_rows(q, dc)
    extra = dict(tiles=chosen.tiles) if chosen.kernel == "triton" else {}
    module.launch(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, softmax_scale * LOG2E, plan,
                  causal=causal, num_splits=ns, kv_format=kv_format, opts=kernel_opts, **extra)
    sms = _sm_count(q.device)
    if not direct:
        # tbq4: the combine rotates the output back as it merges, when its programs (16 heads × 128 columns
        # each) fill half the SMs; fewer programs run faster as a plain combine and a rotation
        if tbq and out.stride(-1) == 1 and B * S * -(-H // 16) * (dc // 128) >= sms // 2:
            combine_rotate(mid_o, mid_lse, out, lse)
            return (out, lse) if return_lse else out
        combine_splits(mid_o, mid_lse, out, lse, sms)
    if tbq:
        rotate_rows(out, dc, out=out)
    return (out, lse) if return_lse else out
