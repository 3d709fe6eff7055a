"""Tunes the fused-MoE GEMMs' tile configurations on this GPU (`specmla.ops.moe.tune`: the search) for preset or
given shapes and writes them as a shipped table, `specmla/ops/moe/configs/<device>.json`, or --out-json.
(`specmla tune --ops moe --model DIR` runs the same search for one model's shape into the user's folder.)

Writes (merging with the rows already there) {"up,E,I,H": [[max_tokens, config], ...], "down,E,H,I": [...]} (N then
K of each GEMM), or --out-json PATH (a file, or a folder to hold <device>.json).

    PYTHONPATH=. python3 benchmarks/tune_moe.py                          (both shapes, ~8 min on an H100)
    PYTHONPATH=. python3 benchmarks/tune_moe.py --out-json OUT/ --report OUT/tune_moe.json  (OUT/<device>.json)
    PYTHONPATH=. python3 benchmarks/tune_moe.py --shapes v2-lite --buckets 1 8 32 --out-json /tmp/h100.json
    PYTHONPATH=. python3 benchmarks/tune_moe.py --shape 64,6,2048,1408,2816        (E,k,H,I,Is)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specmla.ops.moe.tune import BUCKETS, fmt, merge_rows, tune_shape
from specmla.ops import tuned
from specmla.ops.moe.tuning import Config

SHAPES = {  # name: (E, k, H, I, Is), as in bench_moe.py
    "v2-lite": (64, 6, 2048, 1408, 2 * 1408),
    "v3": (256, 8, 7168, 2048, 2048),
}


def output_path(out_json: str | None, key: str) -> Path:
    """Where the table goes: configs/<key>.json by default; out_json as a file, or <key>.json in out_json when it
    is a folder (an existing one, or any path ending in "/")."""
    if out_json is None:
        return tuned.shipped_file("moe", key)
    out = Path(out_json)
    return out / f"{key}.json" if out.is_dir() or out_json.endswith("/") else out


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    vals = tuple(int(v) for v in text.split(","))
    if len(vals) != 5 or min(vals[:4]) < 1 or vals[4] < 0:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected E,k,H,I,Is (Is = 0: no shared experts)")
    return vals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--shape", type=parse_shape, action="append", default=[],
                    help="E,k,H,I,Is of another shape (repeatable; replaces --shapes)")
    ap.add_argument("--buckets", type=int, nargs="+", default=BUCKETS)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole search")
    ap.add_argument("--reps", type=int, default=5, help="timed replays per candidate (median)")
    ap.add_argument("--out-json", default=None,
                    help="write this file (or <device>.json in this folder) instead of "
                         "specmla/ops/moe/configs/<device>.json")
    ap.add_argument("--report", default=None, help="also write the search's timings (JSON) here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_moe needs a CUDA GPU")
    dev = torch.device("cuda")
    shapes = args.shape or [SHAPES[s] for s in args.shapes]
    buckets = sorted(set(args.buckets))
    out = output_path(args.out_json, tuned.cuda_device_key(dev))
    print(f"{torch.cuda.get_device_name(dev)}: tuning {len(shapes)} shape(s) × buckets {buckets} in ≤ "
          f"{args.budget:.0f}s → {out}", flush=True)
    start = time.monotonic()
    report = []
    table = json.loads(out.read_text()) if out.exists() else {}
    bar = tqdm(total=len(shapes) * len(buckets), desc="buckets", unit="bucket")

    def done(row: dict) -> None:
        bar.update(1)
        tqdm.write(f"  E={row['E']} k={row['k']} H={row['H']} I={row['I']} T={row['T']}: {row['us']:.1f} µs  "
                   f"up {fmt(Config(**row['up']))}  down {fmt(Config(**row['down']))}  ({row['timed']} timed)")
        report.append(row)

    for i, (E, k, H, I, Is) in enumerate(shapes):
        budget = max(0.0, start + args.budget - time.monotonic()) / (len(shapes) - i)
        rows, _ = tune_shape(E, k, H, I, Is, buckets, budget, dev, reps=args.reps, on_bucket=done)
        for key, key_rows in rows.items():
            merge_rows(table, key, key_rows)
        out.parent.mkdir(parents=True, exist_ok=True)  # written after each shape: a cut-off run keeps what it has
        out.write_text(json.dumps(table, indent=1) + "\n")
    bar.close()
    print(f"wrote {out} after {time.monotonic() - start:.0f}s", flush=True)
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "buckets": report}, f,
                      indent=1)


if __name__ == "__main__":
    main()
