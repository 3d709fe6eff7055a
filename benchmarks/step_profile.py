"""Where a decode step's time goes: B requests stepped by the engine under torch.profiler, each GPU kernel (on CPU:
each aten op, by its own time) summed per step and grouped by what it does, against the step's time measured
without the profiler and the step's bytes floor (weights + KV at the copy rate).

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_engine.py --checkpoint-dir DIR --load-format dummy \
        --no-decode --profile 1 8
"""

from __future__ import annotations

import random
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specmla import LLM, SamplingParams
from specmla.ops.timing import synchronize

# (group, pattern over kernel or op names): the first match names a kernel's group
GROUPS = (
    ("MoE gate‖up", r"_gate_up(_fp8)?_kernel"),
    ("MoE down", r"_down(_fp8)?_kernel"),
    ("MoE align + sum", r"_align_(count|place)_kernel|_sum_kernel"),
    ("MoE router", r"_moe_route_kernel"),
    ("MLA decode", r"_mla_decode_(?!combine)\w*kernel"),
    ("MLA combine + rotation", r"_mla_decode_combine_kernel|_combine_rotate_kernel|_rotate_rows_kernel"),
    ("RMSNorm", r"_rms_norm(_pair)?_kernel"),
    ("rope + cache write", r"_rope_kernel|_write_(quantized|rows)_kernel|_prologue_kernel"),
    ("FP8 linear", r"_act_quant_kernel|_splitk_kernel|_gemm_kernel"),
    ("small-M GEMV (Triton)", r"_gemv_kernel"),
    ("GEMM / GEMV (cuBLAS, aten)", r"gemm|gemv|nvjet|cutlass|xmma|cublas|aten::(mm|addmm|bmm|baddbmm|matmul|linear)$"),
    ("sampling + step bookkeeping", r"_accept_and_place_kernel|_advance_kernel|argmax|sort|topk|softmax|multinomial"),
    ("copies, cat, pointwise", r"copy|cat|fill|elementwise|index|scatter|gather|memcpy|memset"),
)
_COMPILED = [(g, re.compile(p)) for g, p in GROUPS]
OTHER = "other"


def group_of(name: str) -> str:
    """The group (`GROUPS`) of a kernel or op name; OTHER where none matches."""
    for group, pattern in _COMPILED:
        if pattern.search(name):
            return group
    return OTHER


def _kernel_times(prof, on_gpu: bool) -> dict[str, tuple[float, int]]:
    """{name: (total µs, calls)} of the profiled window: GPU kernels' device time, or on CPU every op's own time
    (without its children, so nested ops are not counted twice)."""
    out = {}
    for e in prof.key_averages():
        if on_gpu:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None)
            if us is None:  # torch < 2.4
                us = e.self_cuda_time_total
        else:
            if e.key.startswith(("ProfilerStep", "[memory]")):
                continue
            us = e.self_cpu_time_total
        if us > 0:
            t, n = out.get(e.key, (0.0, 0))
            out[e.key] = (t + us, n + e.count)
    return out


def profile_decode(llm: LLM, batch: int, prompt_len: int, floor_s: float, steps: int = 32, warm: int = 4,
                   seed: int = 7) -> dict:
    """B fresh random prompts of `prompt_len` tokens, stepped until every one has its first token, `warm` decode
    steps, `steps` decode steps timed without the profiler (the step time), then `steps` more under it (the
    kernels). Returns per group and per kernel: µs per call, calls per step, µs per step, its share of the step and
    of `floor_s`; and the GPU's busy share of the step (kernel time / step time). The requests are aborted after."""
    eng, cfg = llm.engine, llm.model.config
    if eng.has_unfinished():
        raise RuntimeError("the step profile needs an idle engine")
    device = llm.kv_pool.device
    on_gpu = device.type == "cuda"
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=warm + 2 * steps + 2, temperature=0, ignore_eos=True)
    seqs = [eng.add_request([rng.randrange(3, cfg.vocab_size) for _ in range(prompt_len)], params)
            for _ in range(batch)]
    try:
        while not all(s.output_ids for s in seqs):
            eng.step()
        for _ in range(warm):
            eng.step()
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        synchronize(device)
        step_s = (time.perf_counter() - t0) / steps
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                eng.step()
            synchronize(device)
        if any(s.is_finished for s in seqs):
            raise RuntimeError("a request finished inside the profiled window")
    finally:
        for s in seqs:
            eng.abort(s)
    kernels = []
    for name, (us, calls) in _kernel_times(prof, on_gpu).items():
        kernels.append({"name": name, "group": group_of(name), "us_per_call": us / calls,
                        "calls_per_step": calls / steps, "us_per_step": us / steps})
    kernels.sort(key=lambda k: -k["us_per_step"])
    groups = {}
    for k in kernels:
        g = groups.setdefault(k["group"], {"group": k["group"], "us_per_step": 0.0, "calls_per_step": 0.0})
        g["us_per_step"] += k["us_per_step"]
        g["calls_per_step"] += k["calls_per_step"]
    step_us = step_s * 1e6
    for row in [*groups.values(), *kernels]:
        row["step_share"] = row["us_per_step"] / step_us
        row["floor_share"] = row["us_per_step"] / (floor_s * 1e6) if floor_s == floor_s and floor_s > 0 else None
    for g in groups.values():
        g["us_per_call"] = g["us_per_step"] / g["calls_per_step"]
    busy = sum(k["us_per_step"] for k in kernels)
    return {"batch": batch, "prompt_len": prompt_len, "steps": steps, "step_s": step_s, "floor_s": floor_s,
            "timed": "GPU kernels (device time)" if on_gpu else "CPU ops (own time)", "busy_us_per_step": busy,
            "busy_share": busy / step_us, "groups": sorted(groups.values(), key=lambda g: -g["us_per_step"]),
            "kernels": kernels}


def format_profile(res: dict, top: int = 12) -> str:
    """The profile as two markdown tables: per group, then the `top` kernels."""
    floor = res["floor_s"]
    floor_text = f"floor {floor * 1e3:.2f} ms" if floor == floor and floor > 0 else "no floor"
    lines = [f"B={res['batch']}, {res['prompt_len']}-token prompts: step {res['step_s'] * 1e3:.2f} ms ({floor_text}); "
             f"{res['timed']} {res['busy_us_per_step']:.0f} µs a step ({res['busy_share']:.0%} of it), "
             f"{res['steps']} steps",
             *(["kernels overlap (more device time than step time): with programmatic dependent launch (sm_90+) a "
                "kernel starts inside its predecessor and waits for it, so its time includes that wait; the split "
                "below is an upper bound per kernel, the step time is the measure"]
               if res["busy_share"] > 1.0 else []),
             "| group | µs per call | calls per step | µs per step | share of step | share of floor |",
             "|---|---|---|---|---|---|"]

    def share(x):
        return "n/a" if x is None else f"{x:.0%}"

    for g in res["groups"]:
        lines.append(f"| {g['group']} | {g['us_per_call']:.1f} | {g['calls_per_step']:.0f} | {g['us_per_step']:.0f} | "
                     f"{share(g['step_share'])} | {share(g['floor_share'])} |")
    lines += ["", "| kernel | group | µs per call | calls per step | µs per step | share of step |",
              "|---|---|---|---|---|---|"]
    for k in res["kernels"][:top]:
        name = k["name"] if len(k["name"]) <= 60 else k["name"][:57] + "..."
        lines.append(f"| `{name}` | {k['group']} | {k['us_per_call']:.1f} | {k['calls_per_step']:.0f} | "
                     f"{k['us_per_step']:.0f} | {share(k['step_share'])} |")
    return "\n".join(lines)
