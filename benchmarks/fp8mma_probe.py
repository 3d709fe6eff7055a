"""Issue-7 probe: the e4m3-matmul fp8 and tbq4 kernels against bf16 and the unpacking fp8 kernel
(`ops.mla_decode_gluon_quant`) in the same run, with their timing probes (`PROBE`, wrong results).
- `ops.mla_decode_gluon_fp8mma` ("mma"): the producer writing no Vᵀ (1), the consumers handing every stage back (2),
  Pᵀ stored keys-major (3); "_t4": the transpose of four keys × one word per thread (`TRANSPOSE_16 = False`).
- `ops.mla_decode_gluon_fp8reg` ("reg", Vᵀ in registers): no P·V (1), P·V on zeros with no Vᵀ loads (2), no softmax
  reductions (3), no Q·Kᵀ (4), the producer alone (5), no key blocks: the fixed costs (6); no copies, the consumers
  alone (`NO_COPY`; "reg1_alone_*" with the others too, P in one term); "_q_one_term": q in one e4m3 term
  (`Q_SPLIT = False`); "_lag1": the producer refills the stage of the block before the one it hands over;
  "_scale_box_16": 64-byte scale boxes; "_p_one_term" / "_p_two_terms": Pᵀ in one / two e4m3 terms (`P16 = False`);
  "reg16_*": P·V in fp16 (`P16`, the default), "_q_apart": q's two terms as two matmuls (`Q_CAT = False`),
  "_no_loader": the producer refills the stages (no loader warp, `LOADER = False`), "reg16_loader": the one-warp
  copy partition (`LOADER`); "tbq4_rope_via_raw": the rope through the raw ring (`ROPE_DIRECT = False`),
  "tbq4_raw4": 4 raw stages of 17 KB (no gain); "_splits_half" / "_double": half / twice the split count;
  "reg16_steal": programs whose share is done help the share with the most blocks left (`STEAL`; "_min2" / "_min8":
  `STEAL_MIN_BLOCKS`, "_3seg": up to two shares helped, "_claim4": four blocks per atomic);
  "reg16_rows608": the same kernel on 608-byte rows, the size of a row whose rope is int8 with 8 fp16 scales
  (`rows608_descriptors`: what a smaller fp8 format would gain in copies, before the rope's conversion costs);
  "rope_int8": the kernel on real fp8_rope_int8 rows (the producer converts the rope, the loader warp issues the
  copies: `ROPE_INT8_LOADER`), "_producer_alone" its PROBE 5, "_no_loader": the producer refills the stages,
  "_early": … before preparing a block (`REFILL_EARLY`; "reg16_early" on fp8 rows), "_lag1_early": … refilling the
  previous block's stage; "tbq4_rows352": the tbq4 kernel on 352-byte rows (an int8 rope with its scales:
  `rows352_descriptors`).

- `ops.mla_decode_gluon_tbq4reg` ("tbq4_reg") against the unpacking kernel ("tbq4_unpack"), with its probes (`PROBE`
  bits): no decode (1), no copies (2), the consumers alone (3), the producer alone (4), the copies alone (13), no
  scales (8); "_regs_208_80": 80 producer registers. (Variants measured in the fourteenth session and removed:
  docs/benchmarks.md, issue 7.)

    PYTHONPATH=.:benchmarks python3 benchmarks/fp8mma_probe.py [--out DIR] [--cases 16x32x32768x1,...]
"""
import argparse
import contextlib
import json
import os

import torch
from bench_mla_decode import SCALE, kv_decode_bytes, make_problem, time_fn
from fp8_probe import settings as module_settings
from limits import copy_bandwidth

from specmla.ops.decode.hopper import fp8mma as M
from specmla.ops.decode.hopper import fp8 as R
from specmla.ops.decode.hopper import tbq4 as T
from specmla.ops.decode import triton as D
from specmla.ops.decode.triton import mla_decode_triton, plan

DS = "fp8_ds_mla"  # FlashMLA's 656-byte rows, the layout most of these probes measured


def rows608_descriptors(kv_cache: torch.Tensor, scale_words: int = 4) -> tuple:
    """(Timing probe, wrong results) `M._descriptors` over the same bytes read as 608-byte rows: the four code boxes
    (bytes 0-511) and the scales (512-527) as now, and the rope box at byte 528 of a 304-element bf16 row, so TMA
    reads 80 bytes (an int8 rope and its scales' worth) and fills the box's last 48 with zeros."""
    flat = kv_cache.view(-1)
    rows = flat.numel() // 608

    def view(dtype, width):
        return flat.view(dtype).as_strided((rows, width), (width, 1))

    return (M.TensorDescriptor.from_tensor(view(torch.float8_e4m3fn, 608), [M.BLOCK_N, 128],
                                           M.gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)),
            M.TensorDescriptor.from_tensor(view(torch.bfloat16, 304), [M.BLOCK_N, 64],
                                           M.gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)),
            M.TensorDescriptor.from_tensor(view(torch.float32, 152), [M.BLOCK_N, scale_words],
                                           M.gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)))


def rows352_descriptors(kv_cache: torch.Tensor) -> tuple:
    """(Timing probe, wrong results) `T._descriptors` over the same bytes read as 352-byte rows, the size of a tbq4
    row whose rope is int8 with 8 fp16 scales: codes and norms as now, and the rope box at byte 272 of a 176-element
    bf16 row, so TMA reads 80 bytes and fills the box's last 48 with zeros."""
    flat = kv_cache.view(-1)
    rows = flat.numel() // 352

    def view(dtype, width):
        return flat.view(dtype).as_strided((rows, width), (width, 1))

    return (M.TensorDescriptor.from_tensor(view(torch.int32, 88), [T.BLOCK_N, T.CODE_BOX],
                                           M.gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)),
            M.TensorDescriptor.from_tensor(view(torch.float16, 176), [T.BLOCK_N, 8],
                                           M.gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)),
            M.TensorDescriptor.from_tensor(view(torch.bfloat16, 176), [T.BLOCK_N, 64],
                                           M.gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)))


VARIANTS = (("bf16", "bf16", M, {}), ("fp8_unpack", DS, R, dict(USE=False)),
            ("fp8_mma", DS, (M, R), (dict(USE=True), dict(USE=False))),
            ("mma_no_vt", DS, (M, R), (dict(USE=True, PROBE=1), dict(USE=False))),
            ("mma_producer_alone", DS, (M, R), (dict(USE=True, PROBE=2), dict(USE=False))),
            ("fp8_reg", DS, R, dict(USE=True)), ("reg_lag1", DS, R, dict(USE=True, REFILL_LAG=1)),
            ("reg_scale_box_16", DS, R, dict(USE=True, SCALE_WORDS=16)),
            ("reg_p_one_term", DS, R, dict(USE=True, P16=False, P_SPLIT=False)),
            ("reg_regs_232_40", DS, R, dict(USE=True, REGS=(232, 40))),
            ("reg_splits_half", DS, R, dict(USE=True, num_splits=0.5)), ("reg_splits_double", DS, R,
                                                                             dict(USE=True, num_splits=2.0)),
            ("reg_no_pv", DS, R, dict(USE=True, PROBE=1)), ("reg_no_vt_loads", DS, R, dict(USE=True, PROBE=2)),
            ("reg_no_softmax", DS, R, dict(USE=True, PROBE=3)), ("reg_no_qk", DS, R, dict(USE=True, PROBE=4)),
            ("reg_producer_alone", DS, R, dict(USE=True, PROBE=5)),
            ("reg_consumers_alone", DS, R, dict(USE=True, NO_COPY=True, P16=False, P_SPLIT=False)),
            ("reg_consumers_alone_p_split", DS, R, dict(USE=True, NO_COPY=True, P16=False)),
            ("reg1_q_one_term", DS, R, dict(USE=True, P16=False, P_SPLIT=False, Q_SPLIT=False)),
            ("reg1_alone_q_one_term", DS, R, dict(USE=True, NO_COPY=True, P16=False, P_SPLIT=False, Q_SPLIT=False)),
            ("reg1_alone_no_pv", DS, R, dict(USE=True, NO_COPY=True, P16=False, P_SPLIT=False, PROBE=1)),
            ("reg1_alone_no_vt_loads", DS, R, dict(USE=True, NO_COPY=True, P16=False, P_SPLIT=False, PROBE=2)),
            ("reg1_alone_no_softmax", DS, R, dict(USE=True, NO_COPY=True, P16=False, P_SPLIT=False, PROBE=3)),
            ("reg1_alone_no_qk", DS, R, dict(USE=True, NO_COPY=True, P16=False, P_SPLIT=False, PROBE=4)),
            ("reg_no_blocks", DS, R, dict(USE=True, PROBE=6)),
            ("tbq4_unpack", "tbq4", T, dict(USE=False)), ("tbq4_reg", "tbq4", T, dict(USE=True)),
            ("tbq4_no_decode", "tbq4", T, dict(USE=True, PROBE=1)),
            ("tbq4_no_copy", "tbq4", T, dict(USE=True, PROBE=2)),
            ("tbq4_consumers_alone", "tbq4", T, dict(USE=True, PROBE=3)),
            ("tbq4_producer_alone", "tbq4", T, dict(USE=True, PROBE=4)),
            ("tbq4_copies_alone", "tbq4", T, dict(USE=True, PROBE=13)),
            ("tbq4_no_scales", "tbq4", T, dict(USE=True, PROBE=8)),
            ("tbq4_regs_208_80", "tbq4", T, dict(USE=True, REGS=(208, 80))),
            ("reg1_splits_1x", DS, R, dict(USE=True, P16=False, P_SPLIT=False, num_splits=1.0)),
            ("reg1_no_blocks", DS, R, dict(USE=True, P16=False, P_SPLIT=False, PROBE=6)),
            ("reg1_no_blocks_splits_1x", DS, R, dict(USE=True, P16=False, P_SPLIT=False, PROBE=6, num_splits=1.0)),
            ("reg1_producer_alone", DS, R, dict(USE=True, P16=False, P_SPLIT=False, PROBE=5)),
            ("reg1_producer_alone_splits_1x", DS, R, dict(USE=True, P16=False, P_SPLIT=False, PROBE=5,
                                                             num_splits=1.0)),
            ("reg1_lag1", DS, R, dict(USE=True, P16=False, P_SPLIT=False, REFILL_LAG=1)),
            ("tbq4_cb32", "tbq4", T, dict(USE=True, CODE_BOX=32)),
            ("tbq4_cb64", "tbq4", T, dict(USE=True, CODE_BOX=64)),
            ("tbq4_copies_alone_cb32", "tbq4", T, dict(USE=True, PROBE=13, CODE_BOX=32)),
            ("tbq4_copies_alone_cb64", "tbq4", T, dict(USE=True, PROBE=13, CODE_BOX=64)),
            ("tbq4_splits_1x", "tbq4", T, dict(USE=True, num_splits=1.0)),
            ("tbq4_cb64_splits_1x", "tbq4", T, dict(USE=True, CODE_BOX=64, num_splits=1.0)),
            ("tbq4_separate_rotate", "tbq4", D, dict(TBQ4_COMBINE_ROTATE=False)),
            ("reg_p16", DS, R, dict(USE=True, P16=True)),
            ("reg_p_two_terms", DS, R, dict(USE=True, P16=False, P_SPLIT=True)),
            ("reg16_consumers_alone", DS, R, dict(USE=True, P16=True, NO_COPY=True)),
            ("reg16_producer_alone", DS, R, dict(USE=True, P16=True, PROBE=5)),
            ("reg16_q_one_term", DS, R, dict(USE=True, P16=True, Q_SPLIT=False)),
            ("reg16_q_apart", DS, R, dict(USE=True, P16=True, Q_CAT=False)),
            ("reg16_lag1", DS, R, dict(USE=True, P16=True, REFILL_LAG=1)),
            ("reg16_regs_232_40", DS, R, dict(USE=True, P16=True, REGS=(232, 40))),
            ("reg16_loader", DS, R, dict(USE=True, P16=True, LOADER=True, REGS=(224, 40))),
            ("reg16_loader_producer_alone", DS, R, dict(USE=True, P16=True, LOADER=True, REGS=(224, 40), PROBE=5)),
            ("tbq4_rope_via_raw", "tbq4", T, dict(USE=True, ROPE_DIRECT=False, NUM_RAW=3)),
            ("tbq4_raw4", "tbq4", T, dict(USE=True, NUM_RAW=4)),
            ("reg16_no_loader", DS, R, dict(USE=True, P16=True, LOADER=False, REGS=(224, 56))),
            ("reg16_no_loader_producer_alone", DS, R, dict(USE=True, P16=True, LOADER=False, REGS=(224, 56),
                                                              PROBE=5)),
            ("reg16_steal", DS, R, dict(USE=True, STEAL=True)),
            ("reg16_steal_min2", DS, R, dict(USE=True, STEAL=True, STEAL_MIN_BLOCKS=2)),
            ("reg16_steal_min8", DS, R, dict(USE=True, STEAL=True, STEAL_MIN_BLOCKS=8)),
            ("reg16_steal_3seg", DS, R, dict(USE=True, STEAL=True, STEAL_SEGMENTS=3)),
            ("reg16_steal_claim4", DS, R, dict(USE=True, STEAL=True, STEAL_CLAIM=4)),
            ("reg16_steal_producer_alone", DS, R, dict(USE=True, STEAL=True, PROBE=5)),
            ("reg16_rows608", DS, (R, M), (dict(USE=True), dict(_descriptors=rows608_descriptors))),
            ("reg16_rows608_producer_alone", DS, (R, M), (dict(USE=True, PROBE=5),
                                                             dict(_descriptors=rows608_descriptors))),
            ("rope_int8", "fp8", R, dict(USE=True)),
            ("rope_int8_producer_alone", "fp8", R, dict(USE=True, PROBE=5)),
            ("rope_int8_no_loader", "fp8", R, dict(USE=True, ROPE_INT8_LOADER=False)),
            ("rope_int8_early", "fp8", R, dict(USE=True, ROPE_INT8_LOADER=False, REFILL_EARLY=True)),
            ("rope_int8_lag1_early", "fp8", R, dict(USE=True, ROPE_INT8_LOADER=False, REFILL_EARLY=True,
                                                              REFILL_LAG=1)),
            ("reg16_early", DS, R, dict(USE=True, REFILL_EARLY=True)),
            ("tbq4_rows352", "tbq4", T, dict(USE=True, _descriptors=rows352_descriptors)))
if os.environ.get("FP8MMA_VARIANTS"):  # a subset by name, e.g. bf16,fp8_reg
    VARIANTS = tuple(v for v in VARIANTS if v[0] in os.environ["FP8MMA_VARIANTS"].split(","))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default="16x32x32768x1,16x4x81920x1,16x32x32768x2")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for case in args.cases.split(","):
        H, B, T, S = (int(x) for x in case.split("x"))
        res = {"case": [H, B, T, S]}
        for kv in ("bf16", DS, "fp8", "tbq4"):
            if not any(v[1] == kv for v in VARIANTS):
                continue
            caches, table, seq, qs = make_problem(H, B, T, S, 4, kv)
            nb = kv_decode_bytes(kv, B * T, B, S, H)
            o = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
            for name, fmt, module, settings in VARIANTS:
                if fmt != kv:
                    continue
                modules, all_settings = (module, settings) if isinstance(module, tuple) else ((module,), (settings,))
                all_settings = [dict(x) for x in all_settings]
                splits = all_settings[0].pop("num_splits", None)  # a factor on the default split count
                if splits is not None:
                    splits = max(1, int(plan(B, S, H, T, o.device, 64, waves=1)["num_splits"] * splits))
                with contextlib.ExitStack() as stack:
                    for mod, values in zip(modules, all_settings):
                        stack.enter_context(module_settings(values, mod))
                    t = time_fn(lambda i, qs=qs, caches=caches, kv=kv: mla_decode_triton(
                        qs[i], caches[i], table, seq, SCALE, out=o, head_dim_v=512, kv_format=kv, num_splits=splits),
                        4, graph=True)
                res[name] = dict(us=t * 1e6, pct_copy=100 * nb / t / bw)
            del caches, qs
            torch.cuda.empty_cache()
        for name, *_ in VARIANTS[1:]:
            if name in res and "bf16" in res:
                res[name]["x_bf16"] = res["bf16"]["us"] / res[name]["us"]
        print(json.dumps({k: ({a: round(b, 3) for a, b in v.items()} if isinstance(v, dict) else v)
                          for k, v in res.items()}), flush=True)
        rows.append(res)
    with open(os.path.join(args.out, "fp8mma_probe.json"), "w") as f:
        json.dump({"copy_GBps": bw / 1e9, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
