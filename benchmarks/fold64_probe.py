"""Variants of the 64-row fp8 kernel for several query tokens (`ops.mla_decode_gluon_fp8fold`), each timed in the same
run as bf16 on the same shape (the kernel taken through `mla_decode_triton.FOLDED_E4M3_FORMATS`): module settings by
name (FOLD64_VARIANTS, ';'-separated NAME=KEY:JSON&KEY:JSON, e.g. "default;loader=LOADER:true&REGS:[232,40];
copies=PROBE:1"). PROBE variants give wrong results: only their times count; the others' outputs are compared with
the "default" variant's (max |difference| / max |output|, same seeded inputs). `--module NAME` sets another
`specmla.ops` module's constants instead (e.g. `--module mla_decode_seesaw --kv bf16`: bf16's own kernel). GPU only.

    FOLD64_VARIANTS="default;copies=PROBE:1" PYTHONPATH=.:benchmarks python3 benchmarks/fold64_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import importlib
import json
import os

import torch
from bench_mla_decode import SCALE, make_problem, parse_case, time_fn

from specmla.ops.decode import triton as T


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """'name=KEY:VALUE&KEY:VALUE;…' → [(name, {KEY: value})] (values as JSON; 'default' has none)."""
    out = []
    for item in filter(None, text.split(";")):
        name, _, rest = item.partition("=")
        settings = {}
        for kv in filter(None, rest.split("&")):
            key, _, value = kv.partition(":")
            settings[key] = json.loads(value)
        out.append((name, settings))
    return out


def time_call(kv: str, H: int, B: int, T_: int, S: int, fold: bool = True) -> tuple[float, torch.Tensor]:
    """Seconds per call, and the output of the first input (the same seeded inputs for every variant); fold: through
    the 64-row fp8 kernel's route (off by default), else the default route."""
    T.FOLDED_E4M3_FORMATS = ("fp8", "fp8_ds_mla") if fold else ()
    torch.manual_seed(0)
    caches, table, seq, qs = make_problem(H, B, T_, S, 2, kv)
    out = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
    first = T.mla_decode_triton(qs[0], caches[0], table, seq, SCALE, head_dim_v=512, kv_format=kv).float()
    t = time_fn(lambda i: T.mla_decode_triton(qs[i], caches[i], table, seq, SCALE, out=out, head_dim_v=512,
                                              kv_format=kv), 2, graph=True)
    return t, first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="16x32x32768x4,16x32x32768x2")
    ap.add_argument("--kv", default="fp8")
    ap.add_argument("--module", default="mla_decode_gluon_fp8fold", help="the specmla.ops module the variants set")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    module = importlib.import_module("specmla.ops." + args.module)
    variants = parse_variants(os.environ.get("FOLD64_VARIANTS", "default"))
    rows = []
    for case in args.cases.split(","):
        H, B, T_, S = parse_case(case)
        base, _ = time_call("bf16", H, B, T_, S)
        ref = None  # the "default" variant's output: the others' (non-PROBE) outputs are compared with it
        print(f"{case} bf16 {base * 1e6:.1f} us", flush=True)
        rows.append({"case": case, "variant": "bf16", "s": base})
        for name, settings in variants:
            saved = {k: getattr(module, k) for k in settings}
            for k, v in settings.items():
                setattr(module, k, tuple(v) if isinstance(v, list) else v)
            try:
                t, first = time_call(args.kv, H, B, T_, S, args.module == "mla_decode_gluon_fp8fold")
                if name == "default":
                    ref = first
                diff = None if ref is None else float((first - ref).abs().max() / ref.abs().max())
                print(f"{case} {args.kv} {name} {t * 1e6:.1f} us {base / t:.2f}x (max diff from default {diff})",
                      flush=True)
                rows.append({"case": case, "kv": args.kv, "module": args.module, "variant": name, "settings": settings,
                             "s": t, "x_bf16": base / t, "max_diff_from_default": diff})
            finally:
                for k, v in saved.items():
                    setattr(module, k, v)
    with open(os.path.join(args.out, "fold64_probe.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
