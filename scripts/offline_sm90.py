"""Compile Triton launches for Hopper (sm_90) on a machine without a GPU, and report each kernel's
registers, spills and shared memory — so kernel variants can be triaged before spending device time.

    PYTHONPATH=/path/to/triton-3.6:. python3 scripts/offline_sm90.py  # the Triton decode kernel's tiles
    PYTHONPATH=. python3 scripts/offline_sm90.py bf16_seesaw '[[128, 1, 512, 64, "bfloat16", true]]'  # a Gluon one

Use `offline_sm90()` as a context manager around ordinary wrapper calls on CPU tensors: every
`kernel[grid](...)` inside compiles (ptxas included, from the Triton wheel) instead of launching, and
the compiled kernels are collected. Run it with the Triton version of the GPU machine (pip download
triton==X --no-deps; pip install --target DIR) so the figures match what the device will build.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver as _driver
from triton.runtime.jit import JITFunction


class _FakeCudaDriver:
    """Just enough of Triton's CUDA driver for the JIT to specialise and compile, never to launch."""

    def __init__(self, capability: int = 90):
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")


def resource_usage(kernel) -> dict:
    """Registers / spills / shared memory of a compiled kernel, from cuobjdump on its cubin, and whether ptxas
    serialised its wgmmas (each waiting for the one before: too few registers to keep them in flight), from a
    verbose ptxas run on its PTX."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                              capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    regs, stack, shared_static, local = (int(x) for x in m.groups()) if m else (-1, -1, -1, -1)
    return dict(name=kernel.name, regs=regs, stack=stack, local=local, shared=kernel.metadata.shared,
                warps=kernel.metadata.num_warps, stages=getattr(kernel.metadata, "num_stages", None),
                wgmma_serialized=_wgmma_serialized(kernel.asm["ptx"], os.path.join(tools, "ptxas")))


def _wgmma_serialized(ptx: str, ptxas: str) -> bool:
    """Whether ptxas reports serialising the wgmmas of this PTX (its C7512 performance note)."""
    if "wgmma" not in ptx:
        return False
    arch = re.search(r"^\.target\s+(\w+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    return "wgmma.mma_async instructions are serialized" in log.stderr + log.stdout


@contextlib.contextmanager
def offline_sm90(capability: int = 90):
    """Inside: Triton launches compile for `capability` and are recorded (yields the list)."""
    compiled: list = []
    orig_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = orig_run(self, *args, grid=grid, warmup=True, **kwargs)
        if hasattr(kernel, "result"):
            kernel = kernel.result()
        compiled.append(kernel)
        return kernel

    _driver.set_active(_FakeCudaDriver(capability))
    JITFunction.run = run
    try:
        yield compiled
    finally:
        JITFunction.run = orig_run
        _driver.reset_active() if _driver._default is not None else setattr(_driver, "_active", None)


def gluon_decode_usage(cases) -> list[dict]:
    """Compile the Gluon decode kernel for each (H, S, dc, dr, dtype name, direct[, block_n[, options]]) and
    report its resources (the CPU tests run this in a fresh process: Triton's interpreter mode, which the test suite
    turns on, cannot compile). dtype "fp8_ds_mla" / "tbq4": the kernel that dequantises those rows
    (`hopper.dequant`) with bf16 queries; "e4m3_fp8" / "e4m3_fp8_ds_mla": the e4m3 kernel of fp8 rows (`hopper.fp8`),
    "e4m3_tbq4": that of tbq4 rows (`hopper.tbq4`); "seesaw_fp8" / "seesaw_fp8_ds_mla" / "seesaw_tbq4": the 64-row
    kernel that dequantises those rows into fp16 tiles (`hopper.dequant_seesaw`); "folded_fp8" /
    "folded_fp8_ds_mla" / "folded_tbq4": the 64-row kernel with e4m3 Q·Kᵀ on the codes (`hopper.fp8_folded`). The optional options
    item holds fields of the module's `Options`, e.g. {"num_raw": 4}."""
    import importlib

    import torch

    from specmla.ops.decode.hopper import dequant as F
    from specmla.ops.kv_cache import row_spec
    from specmla.ops.decode.dispatch import plan

    rows = []
    for H, S, dc, dr, dtype_name, direct, *rest in cases:
        settings = rest[1] if len(rest) > 1 else {}  # Options fields of an e4m3 kernel
        e4m3, seesaw = dtype_name.startswith("e4m3_"), dtype_name.startswith("seesaw_")
        folded = dtype_name.startswith("folded_")
        kv_format = dtype_name.split("_", 1)[1] if e4m3 or seesaw or folded else dtype_name
        quant = e4m3 or seesaw or folded or kv_format in ("fp8_ds_mla", "tbq4")  # a quantised cache
        dtype = torch.bfloat16 if quant else getattr(torch, dtype_name)
        B = 2
        q = torch.randn(B, S, H, dc + dr, dtype=dtype)
        if quant:
            kv = torch.zeros(8, 64, row_spec(kv_format, dc, dr, dtype)[0], dtype=torch.uint8)
        else:
            kv = torch.randn(8, 64, dc + dr, dtype=dtype)
        table = torch.zeros(B, 4, dtype=torch.int32)
        lens = torch.full((B,), 200, dtype=torch.int32)
        cfg = plan(B, S, H, 256, 8, 64)
        out, lse = torch.empty(B, S, H, dc, dtype=dtype), torch.empty(B, S, H)
        mid_o, mid_lse = torch.empty(B, S, H, 2, dc), torch.empty(B, S, H, 2)
        with offline_sm90() as kernels:
            if seesaw or folded:
                module = importlib.import_module("specmla.ops.decode.hopper."
                                                 + ("fp8_folded" if folded else "dequant_seesaw"))
                module.launch(q, kv, table, lens, mid_o, mid_lse, out, lse, 0.1, cfg, causal=True,
                              num_splits=1 if direct else 2, kv_format=kv_format, opts=module.Options(**settings))
            elif e4m3:
                module = importlib.import_module("specmla.ops.decode.hopper." + ("tbq4" if kv_format == "tbq4"
                                                                                 else "fp8"))
                opts = module.Options(**{k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()})
                module.launch(q, kv, table, lens, mid_o, mid_lse, out, lse, 0.1, cfg, causal=True,
                              num_splits=1 if direct else 2, kv_format=kv_format, opts=opts)
            elif quant:
                F.launch(q, kv, table, lens, mid_o, mid_lse, out, lse, 0.1, cfg, causal=True,
                         num_splits=1 if direct else 2, kv_format=kv_format)
            else:
                raise ValueError(f"{dtype_name}: 16-bit caches take `offline_sm90.py bf16|bf16_seesaw CASES`")
        rows.append(dict(case=[H, S, dc, dr, dtype_name, direct, *rest], kernels=[resource_usage(k) for k in kernels]))
    return rows


def bf16_decode_usage(kernel: str, cases) -> list[dict]:
    """Compile a Hopper decode kernel for 16-bit caches (`kernel`: "bf16", the one-stream kernel, or "bf16_seesaw",
    modules of `specmla.ops.decode.hopper`) for each (H, S, dc, dr, dtype name, direct[, block_n[, options]]) and
    report its resources; options: fields of the kernel's `Options`."""
    import importlib

    import torch

    from specmla.ops.decode.dispatch import plan

    module = importlib.import_module("specmla.ops.decode.hopper." + kernel)
    rows = []
    for H, S, dc, dr, dtype_name, direct, *rest in cases:
        block_n = rest[0] if rest else 64
        opts = module.Options(**(rest[1] if len(rest) > 1 else {}))
        dtype = getattr(torch, dtype_name)
        B = 2
        q = torch.randn(B, S, H, dc + dr, dtype=dtype)
        kv = torch.randn(8, 64, dc + dr, dtype=dtype)
        table = torch.zeros(B, 4, dtype=torch.int32)
        lens = torch.full((B,), 200, dtype=torch.int32)
        cfg = plan(B, S, H, 256, 8, block_n)
        out, lse = torch.empty(B, S, H, dc, dtype=dtype), torch.empty(B, S, H)
        mid_o, mid_lse = torch.empty(B, S, H, 2, dc), torch.empty(B, S, H, 2)
        with offline_sm90() as kernels:
            module.launch(q, kv, table, lens, mid_o, mid_lse, out, lse, 0.1, cfg, causal=True,
                          num_splits=1 if direct else 2, kv_format="bf16", opts=opts)
        rows.append(dict(case=[H, S, dc, dr, dtype_name, direct, *rest], kernels=[resource_usage(k) for k in kernels]))
    return rows


def gluon_prefill_usage(cases) -> list[dict]:
    """Compile the Gluon prefill kernel (`specmla.ops.prefill.hopper`) for each (H, dqk, dv, dtype name,
    causal[, q lengths[, options]]) and report its resources. q lengths: the requests' (default [100, 200], a
    ragged batch; one length: the single-request numbering); options: fields of the module's `Options`."""
    import torch

    from specmla.ops.prefill import hopper as P

    rows = []
    for H, dqk, dv, dtype_name, causal, *rest in cases:
        lens = rest[0] if rest else [100, 200]
        opts = P.Options(**(rest[1] if len(rest) > 1 else {}))
        dtype = getattr(torch, dtype_name)
        T = sum(lens)
        q, k = torch.randn(T, H, dqk, dtype=dtype), torch.randn(T, H, dqk, dtype=dtype)
        v = torch.randn(T, H, dv, dtype=dtype)
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        with offline_sm90() as kernels:
            P.mla_prefill_hopper(q, k, v, cu, cu, max(lens), max(lens), 0.07, causal=causal, opts=opts)
        rows.append(dict(case=[H, dqk, dv, dtype_name, causal, *rest], kernels=[resource_usage(k) for k in kernels]))
    return rows


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) > 2 and sys.argv[1] == "prefill":  # JSON list of gluon prefill cases
        print(json.dumps(gluon_prefill_usage(json.loads(sys.argv[2]))))
        sys.exit(0)
    if len(sys.argv) > 2 and sys.argv[1] in ("bf16", "bf16_seesaw"):  # JSON list of 16-bit-cache decode cases
        print(json.dumps(bf16_decode_usage(sys.argv[1], json.loads(sys.argv[2]))))
        sys.exit(0)
    if len(sys.argv) > 1:  # JSON list of gluon decode cases → JSON resource report on stdout
        print(json.dumps(gluon_decode_usage(json.loads(sys.argv[1]))))
        sys.exit(0)
    import torch

    from specmla.ops import mla_decode

    print("triton", triton.__version__)
    for H, S, B, fmt in ((16, 1, 32, "bf16"), (16, 4, 64, "bf16"), (128, 1, 64, "bf16")):
        q = torch.randn(B, S, H, 576, dtype=torch.bfloat16)
        kv = torch.randn(64, 64, 576, dtype=torch.bfloat16)
        bt = torch.zeros(B, 32, dtype=torch.int32)
        lens = torch.full((B,), 2048, dtype=torch.int32)
        with offline_sm90() as ks:
            mla_decode(q, kv, bt, lens, 0.07, backend="triton")
        for k in ks:
            print(f"H={H} S={S}", resource_usage(k))
