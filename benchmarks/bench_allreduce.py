"""The collectives behind tensor / expert parallelism at a decode step's message sizes (B tokens × hidden 2048,
bf16), each captured 16 times in one CUDA graph and timed per call on rank 0 (median of --reps replays):

- `one_shot`: `ops.all_reduce.one_shot_all_reduce` over `distributed`'s symmetric buffers, what the sharded layers
  call for messages up to its capacity (`model.tp_reduce.tp_all_reduce_`);
- `nccl_all_reduce`: torch.distributed.all_reduce (the layers' path with custom_all_reduce=False);
- `nccl_rs_ag`: reduce-scatter then all-gather (the alternative for a MoE layer's output);
- `symm_one_shot` / `symm_two_shot`: torch's symmetric-memory all-reduce (`torch.ops.symm_mem`, buffers mapped on
  every GPU of the host), after a copy into the symmetric buffer, which the time includes.
Each result is checked against the NCCL all-reduce. A layer's call at B = 1 moves 4 KB: the times are latencies.

    PYTHONPATH=. torchrun --standalone --nproc-per-node 2 benchmarks/bench_allreduce.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fp8 import graph_time  # noqa: E402

from specmla import distributed  # noqa: E402
from specmla.model.tp_reduce import tp_all_reduce_  # noqa: E402
from specmla.ops.all_reduce import BLOCK, MAX_PROGRAMS, symmetric_bytes  # noqa: E402

HIDDEN = 2048


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    distributed.init_group(rank, world, None, "cuda", symmetric_bytes(world))
    group = dist.group.WORLD
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.enable_symm_mem_for_group(group.group_name)
        symm = symm_mem.empty(max(args.batches) * HIDDEN, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(symm, group.group_name)
    except Exception as e:  # an older torch or no P2P: the NCCL rows only
        if rank == 0:
            print(f"symmetric memory unavailable: {type(e).__name__}: {e}", flush=True)
        symm = None
    rows = []
    for B in args.batches:
        n = B * HIDDEN
        g = torch.Generator(device="cuda").manual_seed(rank * 1000 + B)
        x = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16)
        want = x.float().clone()
        dist.all_reduce(want)
        work = x.clone()
        row = {"batch": B, "bytes": n * 2}

        def nccl(_copy=0):
            dist.all_reduce(work)

        shard = torch.empty(n // world, dtype=x.dtype, device="cuda")
        gathered = torch.empty_like(x)

        def rs_ag(_copy=0):
            dist.reduce_scatter_tensor(shard, x)
            dist.all_gather_into_tensor(gathered, shard)

        rs_ag()
        row["rs_ag_max_err"] = (gathered.float() - want).abs().max().item()
        row["nccl_all_reduce_s"] = graph_time(nccl, 1, args.reps, barrier=dist.barrier)
        if distributed.symmetric_buffers() is not None and n <= BLOCK * MAX_PROGRAMS:  # beyond: NCCL's anyway
            mine = x.clone()
            tp_all_reduce_(mine)
            row["one_shot_max_err"] = (mine.float() - want).abs().max().item()
            row["one_shot_s"] = graph_time(lambda _copy=0: tp_all_reduce_(mine), 1, args.reps, barrier=dist.barrier)
        row["nccl_rs_ag_s"] = graph_time(rs_ag, 1, args.reps, barrier=dist.barrier)
        if symm is not None:
            out = torch.empty_like(x)

            def one_shot(_copy=0):
                symm[:n].copy_(x)
                torch.ops.symm_mem.one_shot_all_reduce_out(symm[:n], "sum", group.group_name, out)

            def two_shot(_copy=0):
                symm[:n].copy_(x)
                torch.ops.symm_mem.two_shot_all_reduce_(symm[:n], "sum", group.group_name)

            for name, fn, res in (("symm_one_shot", one_shot, lambda: out), ("symm_two_shot", two_shot,
                                                                             lambda: symm[:n])):
                try:
                    fn()
                    torch.cuda.synchronize()
                    row[f"{name}_max_err"] = (res().float() - want).abs().max().item()
                    row[f"{name}_s"] = graph_time(fn, 1, args.reps, barrier=dist.barrier)
                except Exception as e:
                    row[f"{name}_s"] = None
                    row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        if rank == 0:
            us = {k[:-2]: f"{v * 1e6:.1f} µs" for k, v in row.items() if k.endswith("_s") and v is not None}
            print(f"B={B} ({row['bytes']} bytes): {us}", flush=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_allreduce.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "world": world, "hidden": HIDDEN, "rows": rows}, f,
                      indent=1)
    distributed.destroy_group()


if __name__ == "__main__":
    main()
