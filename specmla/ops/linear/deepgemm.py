"""The FP8 block-scaled linear (contract C7) on DeepGEMM's sm_90 kernel: an optional extra.

`pip install specmla[hopper]` brings the `deep_gemm` package (sgl-deep-gemm on PyPI: DeepSeek's TMA + wgmma FP8 GEMM
with their 1 × 128 activation and 128 × 128 weight scales, JIT-compiled per shape on first use and cached on disk).
Its wheels are built against one torch release; where they do not load, building its `_C` extension from source
against the installed torch works (nvcc and a C++20 compiler). Without it, or off sm_90, `available` is False and
`fp8_block_linear` keeps to the Triton kernels, which stay the portable path and the reference.

The arithmetic is the Triton kernels' w8a8: `act_quant` (the same kernel, writing its scales in the column-major,
16-byte-aligned layout DeepGEMM loads by TMA, so no transpose runs between), then e4m3 products promoted to fp32
every 128 K with both scales. DeepGEMM writes bf16 only: calls with other activation or output dtypes, K not a
multiple of 128 or N not a multiple of 64 are not `supported`.
"""

from __future__ import annotations

import functools
import math

import torch

from specmla.ops.linear.reference import BLOCK, check_fp8_linear_args
from specmla.ops.linear.triton import act_quant

INSTALL_HINT = "pip install 'specmla[hopper]' (the deep_gemm package), on an sm_90 GPU"
MIN_ROWS = 17  # DeepGEMM takes calls from this many rows (K ≥ 2048) ...
MIN_ROWS_SHORT_K = 256  # ... or from this many (K < 2048): below, the Triton split-K kernel is as fast or faster


@functools.lru_cache(maxsize=None)
def module():
    """The imported `deep_gemm` package, or None where it is missing or does not load against this torch."""
    try:
        import deep_gemm
    except Exception:  # ImportError, or an OSError / RuntimeError from a binary built against another torch
        return None
    return deep_gemm


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def available(device: torch.device) -> bool:
    """Whether DeepGEMM's sm_90 kernels can run on `device`: a Hopper GPU and an importable `deep_gemm`."""
    if device.type != "cuda":
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device()) and module() is not None


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None) -> bool:
    """Whether a call fits DeepGEMM's kernel: bf16 x and output, K a multiple of 128, N a multiple of 64, a bf16 or
    fp32 bias (added after the product)."""
    if weight.dim() != 2:
        return False
    N, K = weight.shape
    return (x.dtype == torch.bfloat16 and (out_dtype or x.dtype) == torch.bfloat16 and K % BLOCK == 0
            and N % 64 == 0 and K > 0 and (bias is None or bias.dtype in (torch.bfloat16, torch.float32)))


def preferred(M: int, K: int) -> bool:
    """Whether `fp8_block_linear`'s "auto" sends M rows of a K-wide call to DeepGEMM (where it is available and the
    call `supported`): the rows where it was measured faster than the Triton kernels on an H200 over DeepSeek-V3's
    five linear shapes (docs/benchmarks.md, "FP8 block-scaled linear"): from 17 rows at K ≥ 2048, from 256 at
    K = 1536; up to 16 rows the split-K kernel ties or wins."""
    return M >= (MIN_ROWS if K >= 2048 else MIN_ROWS_SHORT_K)


def routes_to(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None) -> bool:
    """Whether `fp8_block_linear`'s "auto" sends this call to DeepGEMM: its rows `preferred`, DeepGEMM `available`
    on x's device, the call `supported`."""
    return (preferred(math.prod(x.shape[:-1]), weight.shape[-1]) and available(x.device)
            and supported(x, weight, bias, out_dtype))


def fp8_block_linear_deepgemm(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, *,
                              bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Contract C7 on DeepGEMM: x [..., K] bf16 @ (weight · scale)ᵀ (+ bias) → [..., N] bf16, activations quantised
    per token per 128 columns. RuntimeError where DeepGEMM is not `available`, ValueError where the call is not
    `supported`. No host synchronisation; graph-capturable once each M regime has run eagerly (the JIT compiles
    then)."""
    check_fp8_linear_args(x, weight, weight_scale_inv, bias)
    if not available(x.device):
        raise RuntimeError(f"fp8_block_linear: DeepGEMM is not available on {x.device}: {INSTALL_HINT}")
    if not supported(x, weight, bias, out_dtype):
        raise ValueError(f"fp8_block_linear: DeepGEMM takes bf16 x and output, K % 128 == 0 and N % 64 == 0; got x "
                         f"{x.dtype}, out {out_dtype or x.dtype}, weight {tuple(weight.shape)}")
    N, K = weight.shape
    lead = x.shape[:-1]
    M = math.prod(lead)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if M == 0:
        return out.view(*lead, N)
    x2 = x.reshape(M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q, s = act_quant(x2, scales_mn_major=True)
    w = weight if weight.is_contiguous() else weight.contiguous()
    ws = weight_scale_inv if weight_scale_inv.is_contiguous() else weight_scale_inv.contiguous()
    module().fp8_gemm_nt((q, s), (w, ws), out)
    if bias is not None:
        out += bias.to(out.dtype)
    return out.view(*lead, N)
