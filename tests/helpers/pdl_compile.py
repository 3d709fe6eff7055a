"""Compile the decode step's PDL kernels for sm_90 offline (`scripts/offline_sm90.py`) with programmatic dependent
launch forced on, and report which griddepcontrol instructions each kernel's PTX holds.

    PYTHONPATH=/path/to/triton:. python tests/helpers/pdl_compile.py  # JSON on the last line of stdout

Run it in a process without TRITON_INTERPRET (the interpreter cannot compile). The report maps each kernel name to
{"wait": bool, "launch_dependents": bool, "before_wait": the global memory instructions (ld.global..., st.global...,
atom..., red...) the PTX holds before its first griddepcontrol.wait}; the entry "plain:<name>" is a kernel compiled
with PDL off.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# kernel name → the wrapper call below that launches it
KERNELS = [
    "_rms_norm_kernel", "_rms_norm_pair_kernel", "_rope_kernel", "_write_quantized_kernel", "_write_rows_kernel",
    "_moe_route_kernel", "_align_count_kernel", "_align_place_kernel", "_gate_up_kernel", "_down_kernel",
    "_sum_kernel", "_act_quant_kernel", "_gate_up_fp8_kernel", "_down_fp8_kernel", "_mla_decode_split_kernel",
    "_mla_decode_split_tbq4_kernel", "_mla_decode_combine_kernel", "_prologue_kernel", "_gemv_kernel",
    "_chunk_argmax_kernel", "_row_argmax_kernel",
]


def _launch_all() -> None:
    """One call of each wrapper on small CPU tensors (inside `offline_sm90` they compile instead of running)."""
    import torch

    from specmla.ops import mla_decode
    from specmla.ops.argmax import argmax_rows_triton
    from specmla.ops.decode_prologue import mla_decode_prologue
    from specmla.ops.linear.gemv import head_matmul_small_m, linear_small_m
    from specmla.ops.kv_cache import row_spec
    from specmla.ops.kv_cache.triton import write_kv_cache_triton, write_kv_rows_triton
    from specmla.ops.moe.route import RouteSpec, moe_route_triton
    from specmla.ops.moe.triton import fused_moe_fp8_triton, fused_moe_triton
    from specmla.ops.norm import rms_norm_pair_triton, rms_norm_triton
    from specmla.ops.rope import apply_rope_qk_

    bf16 = torch.bfloat16
    x, w = torch.randn(2, 256, dtype=bf16), torch.ones(256, dtype=bf16)
    rms_norm_triton(x, w, 1e-6, residual=x)
    rms_norm_pair_triton(x, x, w, w, 1e-6)
    apply_rope_qk_(torch.randn(2, 4, 64, dtype=bf16), torch.randn(2, 64, dtype=bf16), torch.zeros(2, dtype=torch.int64),
                   torch.randn(16, 64), backend="triton")
    c_kv, k_pe, slots = torch.randn(3, 512, dtype=bf16), torch.randn(3, 64, dtype=bf16), torch.arange(3)
    cache = torch.zeros(2, 16, row_spec("fp8", 512, 64, torch.uint8)[0], dtype=torch.uint8)
    write_kv_cache_triton(cache, c_kv, k_pe, slots, "fp8")
    write_kv_rows_triton(torch.zeros(2, 16, 576, dtype=bf16), c_kv, k_pe, slots)
    E, k, H, I = 8, 2, 256, 128
    moe_route_triton(torch.randn(3, H, dtype=bf16), torch.randn(E, H, dtype=bf16), torch.zeros(E),
                     RouteSpec(top_k=k, n_group=2, topk_group=1, method="noaux_tc", sigmoid=True))
    T = 130  # 390 pairs with the shared slot: the two-launch alignment
    xs = torch.randn(T, H, dtype=bf16)
    wts, ids = torch.rand(T, k), torch.randint(0, E, (T, k))
    fused_moe_triton(xs, torch.randn(E, 2 * I, H, dtype=bf16), torch.randn(E, H, I, dtype=bf16), wts, ids,
                     shared=(torch.randn(2 * I, H, dtype=bf16), torch.randn(H, I, dtype=bf16)), residual=xs)
    fp8 = torch.float8_e4m3fn
    fused_moe_fp8_triton(xs[:4], torch.randn(E, 2 * I, H).to(fp8), torch.randn(E, H, I).to(fp8), wts[:4], ids[:4],
                         w_gate_up_scale=torch.ones(E, 2 * I // 128, H // 128),
                         w_down_scale=torch.ones(E, H // 128, I // 128), residual=xs[:4])
    B, S, Hq = 1, 1, 16
    table, lens = torch.zeros(B, 8, dtype=torch.int32), torch.full((B,), 300, dtype=torch.int32)
    mla_decode(torch.randn(B, S, Hq, 576, dtype=bf16), torch.randn(8, 64, 576, dtype=bf16), table, lens, 0.07,
               backend="triton", num_splits=2)
    T, Hq, dn, dc, dr = 2, 16, 128, 512, 64
    mla_decode_prologue(torch.randn(T, Hq, dn + dr, dtype=bf16), torch.randn(T, dc + dr, dtype=bf16),
                        torch.ones(dc, dtype=bf16), 1e-6, torch.zeros(T, dtype=torch.int64), torch.randn(16, dr),
                        torch.zeros(8, 64, dc + dr, dtype=bf16), torch.arange(T), torch.empty(T, Hq, dc + dr, dtype=bf16),
                        backend="triton")
    linear_small_m(torch.randn(1, 2048, dtype=bf16), torch.randn(2112, 2048, dtype=bf16))  # split-K
    head_matmul_small_m(torch.randn(1, Hq, dn, dtype=bf16), torch.randn(Hq, dn, dc, dtype=bf16))
    argmax_rows_triton(torch.randn(2, 10000))
    tbq = torch.zeros(8, 64, row_spec("tbq4", 512, 64, torch.uint8)[0], dtype=torch.uint8)
    mla_decode(torch.randn(B, S, Hq, 576, dtype=bf16), tbq, table, lens, 0.07, kv_format="tbq4", backend="triton",
               num_splits=2, rotated=True)


def report() -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch

    from offline_sm90 import offline_sm90

    from specmla.ops.norm import rms_norm_triton

    def flags(kernel) -> dict:
        ptx = kernel.asm["ptx"]
        before = ptx.split("griddepcontrol.wait", 1)[0] if "griddepcontrol.wait" in ptx else ""
        return {"wait": "griddepcontrol.wait" in ptx, "launch_dependents": "griddepcontrol.launch_dependents" in ptx,
                "before_wait": sorted(set(re.findall(r"\b(?:ld\.global|st\.global|atom|red|cp\.async)[\w.]*", before)))}

    rows = {}
    with offline_sm90() as kernels:  # an sm_90 target: `pdl_args` turns PDL on for the CPU tensors
        _launch_all()
    for kern in kernels:  # a kernel compiled more than once (other constexprs): every variant counts
        f, seen = flags(kern), rows.get(kern.name)
        rows[kern.name] = f if seen is None else {
            "wait": f["wait"] and seen["wait"],
            "launch_dependents": f["launch_dependents"] and seen["launch_dependents"],
            "before_wait": sorted(set(f["before_wait"]) | set(seen["before_wait"]))}
    with offline_sm90(capability=80) as kernels:  # an sm_80 target: no PDL
        rms_norm_triton(torch.randn(2, 256, dtype=torch.bfloat16), torch.ones(256, dtype=torch.bfloat16), 1e-6)
    rows.update({"plain:" + kern.name: flags(kern) for kern in kernels})
    return rows


if __name__ == "__main__":
    import triton

    print("triton", triton.__version__, file=sys.stderr)
    print(json.dumps(report()))
