"""One MoE layer (router + routed and shared experts) against the torch._grouped_mm sort and the floor, H100.

Two shapes in one run, bf16 random weights (N(0, 0.02)), tokens x ~ N(0, 1):
- DeepSeek-V2-Lite: E = 64 routed experts top-6 (softmax, greedy), 2 shared (Is = 2·1408), H = 2048, I = 1408;
- DeepSeek-V3: E = 256 top-8 (sigmoid + bias, 8 groups top-4, scaling 2.5), 1 shared (Is = 2048), H = 7168, I = 2048.

Per token count T, each candidate is captured once as a CUDA graph and replayed in interleaved rounds
(the order rotates each round); a replay's time comes from CUDA events around it, with the L2 flushed
before (a real step streams other layers' weights between two MoE layers) and the graph launch
hidden behind a spin kernel. Figures are medians over --reps rounds after --warmup rounds.

- ours experts: `specmla.ops.fused_moe(x, w_gate_up, w_down, weights, ids, shared=(sgu, sd))` on a
  random uniform routing (torch.rand(T, E).topk(k): distinct experts per token; weights a softmax);
- router: `specmla.ops.moe_route(x, router_weight, bias, spec)`, timed two ways: one replay of its own
  graph (like the other rows, so it carries the graph launch, reported as "one replay of a one-kernel
  graph" in the same run), and "in a step" (`in_step_us`: 16 × (64 MB L2 flush, router) in one graph
  minus 16 flushes, per call), its cost between other kernels as in a graphed decode step, which is
  what the ≤ 8 µs criterion reads;
- ours layer (the headline): the router, then fused_moe on the router's choice;
- sort: the same router (ours), then ~30 lines of torch: (token, slot) pairs sorted by expert, rows
  gathered, two `torch._grouped_mm` calls with SiLU·up between, the routing weight, `index_add_`
  into the shared experts' output (a dense MLP). Offsets come from `searchsorted` on the sorted ids,
  not `bincount`, whose CUDA version syncs with the host and cannot be captured. "n/a" where
  torch._grouped_mm is missing or refuses the shapes;
- deepgemm (where the `deep_gemm` package imports and the GPU is sm_90): DeepGEMM's bf16 m-grouped contiguous GEMMs
  (`m_grouped_bf16_gemm_nt_contiguous`, prefix-sum layout: each expert's rows start at a multiple of its
  alignment) between torch glue: pairs sorted by expert and gathered into the padded layout, SiLU·up, the
  weighted `index_add_` into the shared experts' dense MLP. "dg_gemms" times the two grouped GEMMs and the SiLU·up
  alone (the library's share of the layer); both after the same router;
- floor = max(bytes / copy bandwidth, FLOPs / bf16 GEMM rate), both ceilings measured in this run
  (limits.py). Bytes: the experts the routing touches (U · 3·H·I) + the shared experts (3·H·Is) +
  the router weight (E·H), all bf16, + x read and out written. limits.copy_bandwidth counts bytes
  read + written, so a floor that only reads weights uses that figure as is (the HBM's rate either
  way). FLOPs: 2·3·H·I·T·k + 2·3·H·Is·T + 2·H·E·T;
- % of GEMM = the layer's FLOPs / its time / the GEMM rate.

The layer's floor counts the experts the router chose (U of the layer's routing); "experts" rows use
the random routing's U. Numbers are checked once per T: ours against the sort on both routings
(relative Frobenius error ≤ 2e-2), and ours against `fused_moe_torch` at the smallest T.

Acceptance (PASS/MISS): speedup vs the sort ≥ 1.5 or floor/ours ≥ 0.85; for V2-Lite also
floor/ours ≥ 0.70 at 8 ≤ T ≤ 128, ≥ 0.60 at T = 1, % of GEMM ≥ 55 at T ≥ 2048, router ≤ 8 µs at T ≤ 128.

    PYTHONPATH=. python3 benchmarks/bench_moe.py --out DIR                       (both shapes, ~4 min)
    PYTHONPATH=. python3 benchmarks/bench_moe.py --shapes v2-lite --tokens 1 8 128 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from limits import copy_bandwidth, gemm_rate

from specmla.ops import fused_moe, fused_moe_torch, moe_route
from specmla.ops.moe import RouteSpec


@dataclass(frozen=True)
class Shape:
    name: str
    E: int  # routed experts
    k: int  # experts per token
    H: int  # hidden size
    I: int  # routed expert intermediate size
    Is: int  # shared experts' intermediate size (all of them together)
    spec: RouteSpec
    bias: bool  # e_score_correction_bias (V3)


SHAPES = {
    "v2-lite": Shape("DeepSeek-V2-Lite", E=64, k=6, H=2048, I=1408, Is=2 * 1408,
                     spec=RouteSpec(top_k=6, method="greedy", v2=True), bias=False),
    "v3": Shape("DeepSeek-V3", E=256, k=8, H=7168, I=2048, Is=2048,
                spec=RouteSpec(top_k=8, n_group=8, topk_group=4, method="noaux_tc", sigmoid=True, norm_topk_prob=True,
                               scaling=2.5), bias=True),
}
TOKENS = [1, 8, 32, 128, 512, 2048, 8192]
CHECK_TOL = 2e-2
SPIN_CYCLES = 200_000  # about 0.1 ms: the GPU spins while the host launches the timed graph
FLUSH_BYTES = 256 << 20  # more than the L2 (50 MB on H100)
IN_STEP_FLUSH_BYTES = 64 << 20  # the L2 flush between two calls inside one graph


# ---- the torch baseline ----------------------------------------------------------------------------
def sort_moe(x, w_gate_up, w_down, weights, ids, shared_gate_up, shared_down):
    """The torch._grouped_mm baseline: pairs sorted by expert, two grouped GEMMs, weighted index_add_ into the
    shared experts' output (computed as a dense MLP)."""
    T, k = ids.shape
    E, I = w_down.shape[0], w_down.shape[2]
    sorted_ids, order = ids.reshape(-1).sort(stable=True)
    tok = order // k
    # offs[e] = pairs of experts 0..e (int32 cumulative ends, as torch._grouped_mm takes them)
    offs = torch.searchsorted(sorted_ids, torch.arange(E, device=ids.device, dtype=sorted_ids.dtype), right=True,
                              out_int32=True)
    gu = torch._grouped_mm(x[tok], w_gate_up.transpose(1, 2), offs=offs)
    h = F.silu(gu[:, :I]) * gu[:, I:]
    y = torch._grouped_mm(h, w_down.transpose(1, 2), offs=offs)
    y = y * weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return shared_mlp(x, shared_gate_up, shared_down).index_add_(0, tok, y)


def shared_mlp(x, shared_gate_up, shared_down):
    """The shared experts as one dense MLP: (silu(gate x) ⊙ up x) @ downᵀ, in x's dtype."""
    Is = shared_down.shape[1]
    gs = x @ shared_gate_up.T
    return (F.silu(gs[:, :Is]) * gs[:, Is:]) @ shared_down.T


class DeepGemmMoE:
    """The DeepGEMM peer: fixed buffers for T tokens (CUDA-graph capturable), E experts of [2I, H] / [H, I]."""

    def __init__(self, dg, E: int, H: int, I: int, T: int, k: int, device):
        self.dg, self.E, self.I, self.k = dg, E, I, k
        self.align = dg.get_mk_alignment_for_contiguous_layout()
        rows = -(-(T * k + E * (self.align - 1)) // self.align) * self.align
        self.a = torch.zeros(rows, H, dtype=torch.bfloat16, device=device)
        self.gu = torch.empty(rows, 2 * I, dtype=torch.bfloat16, device=device)
        self.y = torch.empty(rows, H, dtype=torch.bfloat16, device=device)
        self.pairs = torch.arange(T * k, device=device)
        self.expected_m = max(1, T * k // E)

    def layout(self, ids):
        """(order of the pairs by expert, each pair's row in the padded layout, prefix sums of the expert ends)."""
        flat = ids.reshape(-1).long()
        experts, order = flat.sort(stable=True)
        counts = torch.zeros(self.E, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        padded = (counts + self.align - 1) // self.align * self.align
        starts = padded.cumsum(0) - padded
        dest = starts[experts] + self.pairs - (counts.cumsum(0) - counts)[experts]
        return order, dest, (starts + counts).to(torch.int32)

    def gemms(self, w_gate_up, w_down, psum):
        self.dg.m_grouped_bf16_gemm_nt_contiguous(self.a, w_gate_up, self.gu, psum, use_psum_layout=True,
                                                  expected_m_for_psum_layout=self.expected_m)
        h = F.silu(self.gu[:, :self.I]) * self.gu[:, self.I:]
        self.dg.m_grouped_bf16_gemm_nt_contiguous(h, w_down, self.y, psum, use_psum_layout=True,
                                                  expected_m_for_psum_layout=self.expected_m)

    def __call__(self, x, w_gate_up, w_down, weights, ids, shared_gate_up, shared_down):
        order, dest, psum = self.layout(ids)
        tok = order // self.k
        self.a.index_copy_(0, dest, x[tok])
        self.gemms(w_gate_up, w_down, psum)
        return shared_mlp(x, shared_gate_up, shared_down).index_add_(
            0, tok, self.y[dest] * weights.reshape(-1)[order].unsqueeze(1).to(self.y.dtype))


def deepgemm_status(device):
    """(the deep_gemm module, None) where its sm_90 kernels can run here, else (None, why not)."""
    if torch.cuda.get_device_capability(device) != (9, 0):
        return None, "DeepGEMM's bf16 grouped GEMM: sm_90 only"
    try:
        import deep_gemm
    except Exception as e:  # missing, or built against another torch
        return None, f"deep_gemm does not import: {type(e).__name__}: {str(e)[:200]}"
    return deep_gemm, None


def grouped_mm_status(device) -> str | None:
    """None when torch._grouped_mm runs bf16 grouped GEMMs here, else why not."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        a = torch.randn(32, 64, dtype=torch.bfloat16, device=device)
        b = torch.randn(2, 32, 64, dtype=torch.bfloat16, device=device)  # [E, N, K], used as [E, K, N]
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
        got = torch._grouped_mm(a, b.transpose(1, 2), offs=offs).float()
        want = torch.cat([a[:16].float() @ b[0].float().T, a[16:].float() @ b[1].float().T])
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-1):
            return "torch._grouped_mm gives wrong results"
    except Exception as e:  # unsupported GPU / build
        return f"torch._grouped_mm fails: {type(e).__name__}: {str(e)[:200]}"
    return None


# ---- floors and acceptance (pure python) -------------------------------------------------------------
def layer_flops(s: Shape, T: int, router: bool = True) -> float:
    return 2.0 * 3 * s.H * s.I * T * s.k + 2.0 * 3 * s.H * s.Is * T + (2.0 * s.H * s.E * T if router else 0.0)


def layer_bytes(s: Shape, T: int, unique_experts: int, router: bool = True, elem: int = 2) -> float:
    weights = unique_experts * 3 * s.H * s.I + 3 * s.H * s.Is + (s.E * s.H if router else 0)
    return (weights + 2 * T * s.H) * elem


def floor_us(s: Shape, T: int, unique_experts: int, copy_bw: float, gemm: float, router: bool = True) -> dict:
    """{"bytes_us", "compute_us", "floor_us"}: the layer's bytes over the copy bandwidth, its FLOPs over the
    GEMM rate, and the larger."""
    b = layer_bytes(s, T, unique_experts, router) / copy_bw * 1e6
    c = layer_flops(s, T, router) / gemm * 1e6
    return {"bytes_us": b, "compute_us": c, "floor_us": max(b, c)}


def acceptance(shape_key: str, row: dict) -> tuple[bool, list[str]]:
    """(passes, unmet criteria) of one row: speedup vs the sort ≥ 1.5 or floor/ours ≥ 0.85; V2-Lite also
    floor/ours ≥ 0.70 at 8 ≤ T ≤ 128, ≥ 0.60 at T = 1, % of GEMM ≥ 55 at T ≥ 2048, router ≤ 8 µs at T ≤ 128."""
    T, frac, speedup = row["T"], row.get("floor_frac"), row.get("speedup_vs_sort")
    miss = []
    if frac is None:
        return False, ["no timing"]
    if not ((speedup is not None and speedup >= 1.5) or frac >= 0.85):
        miss.append("speedup<1.5 and floor<85%")
    if shape_key == "v2-lite":
        if 8 <= T <= 128 and frac < 0.70:
            miss.append("floor<70%")
        if T == 1 and frac < 0.60:
            miss.append("floor<60%")
        if T >= 2048 and row.get("gemm_frac", 0.0) < 0.55:
            miss.append("GEMM<55%")
        if T <= 128 and row.get("router_in_step_us", float("inf")) > 8.0:
            miss.append("router>8us")
    if row.get("check") == "FAIL":
        miss.append("numerics")
    return not miss, miss


def _f(v, fmt="{:.1f}", none="n/a") -> str:
    return none if v is None else fmt.format(v)


def format_table(shape: Shape, rows: list[dict]) -> str:
    head = ("| T | ours layer µs | ours experts µs | router µs (in a step / one replay) | sort µs | DeepGEMM layer µs "
            "(its GEMMs) | floor µs | floor/ours | speedup vs sort | % of GEMM | accept |")
    launch = statistics.median(r["launch_us"] for r in rows if "launch_us" in r) if rows else None
    lines = [f"{shape.name}: E={shape.E} top-{shape.k}, H={shape.H}, I={shape.I}, shared Is={shape.Is}; "
             f"one replay of a one-kernel graph: {_f(launch)} µs", head, "|" + "---|" * 11]
    for r in rows:
        acc = "PASS" if r["pass"] else "MISS (" + ", ".join(r["miss"]) + ")"
        lines.append(f"| {r['T']} | {_f(r.get('layer_us'))} | {_f(r.get('experts_us'))} | {_f(r.get('router_in_step_us'))} / "
                     f"{_f(r.get('router_us'))} | {_f(r.get('sort_layer_us'))} | {_f(r.get('dg_layer_us'))} "
                     f"({_f(r.get('dg_gemms_us'))}) | {_f(r['floor_us'])} | {_f(r.get('floor_frac'), '{:.0%}')} "
                     f"| {_f(r.get('speedup_vs_sort'), '{:.2f}x')} | {_f(r.get('gemm_frac'), '{:.0%}')} | {acc} |")
    return "\n".join(lines)


# ---- timing -------------------------------------------------------------------------------------------
def capture(fn):
    """(graph, its output) of fn captured once, after two eager warm-up calls on a side stream (compiles)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def time_graphs(graphs: dict, reps: int, warmup: int, flush: torch.Tensor) -> dict[str, float]:
    """Median µs per replay of each graph: interleaved rounds (rotated order), L2 flushed before each replay,
    the launch hidden behind a spin kernel, CUDA events around the replay."""
    names = list(graphs)
    times = {n: [] for n in names}
    for r in range(warmup + reps):
        order = names[r % len(names):] + names[: r % len(names)]
        evs = []
        for n in order:
            flush.zero_()
            torch.cuda._sleep(SPIN_CYCLES)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graphs[n].replay()
            e.record()
            evs.append((n, s, e))
        torch.cuda.synchronize()
        if r >= warmup:
            for n, s, e in evs:
                times[n].append(s.elapsed_time(e) * 1e3)
    return {n: statistics.median(v) for n, v in times.items()}


def in_step_us(fn, flush: torch.Tensor, reps: int, warmup: int, n: int = 16) -> float:
    """Marginal µs of fn between other kernels of one graph, as in a graphed step: a graph of n × (L2 flush,
    fn) against a graph of n L2 flushes, per call. Unlike one replay per graph, it carries no graph launch."""
    part = flush[: IN_STEP_FLUSH_BYTES // 4]
    with_fn = capture(lambda: [(part.zero_(), fn()) for _ in range(n)])[0]
    without = capture(lambda: [part.zero_() for _ in range(n)])[0]
    t = time_graphs({"with": with_fn, "without": without}, reps, warmup, flush)
    return (t["with"] - t["without"]) / n


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# ---- one shape ----------------------------------------------------------------------------------------
def bench_shape(key: str, s: Shape, tokens: list[int], copy_bw: float, gemm: float, sort_ok: bool, reps: int,
                warmup: int, dev, seed: int = 0, dg=None) -> dict:
    g = torch.Generator(device=dev).manual_seed(seed)
    bf = torch.bfloat16

    def rnd(*shape, std=0.02):
        return torch.empty(*shape, dtype=bf, device=dev).normal_(0.0, std, generator=g)

    w_gate_up, w_down = rnd(s.E, 2 * s.I, s.H), rnd(s.E, s.H, s.I)
    shared = (rnd(2 * s.Is, s.H), rnd(s.H, s.Is))
    router_w = rnd(s.E, s.H)
    bias = torch.empty(s.E, device=dev).normal_(0.0, 0.02, generator=g) if s.bias else None
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=dev)
    res = {"key": key, **{k: v for k, v in asdict(s).items() if k != "spec"}, "spec": asdict(s.spec),
           "expert_weight_GB": 3 * s.E * s.H * s.I * 2 / 1e9, "rows": []}
    print(f"\n{s.name}: {res['expert_weight_GB']:.1f} GB of routed experts", flush=True)
    for T in tokens:
        x = torch.empty(T, s.H, dtype=bf, device=dev).normal_(0.0, 1.0, generator=g)
        ids = torch.rand(T, s.E, device=dev, generator=g).topk(s.k, dim=1).indices
        weights = torch.randn(T, s.k, device=dev, generator=g).softmax(dim=-1)
        r_weights, r_ids = moe_route(x, router_w, bias, s.spec)

        def experts(x=x, w=weights, i=ids):
            return fused_moe(x, w_gate_up, w_down, w, i, shared=shared)

        def router(x=x):
            return moe_route(x, router_w, bias, s.spec)

        def layer(x=x):
            w, i = moe_route(x, router_w, bias, s.spec)
            return fused_moe(x, w_gate_up, w_down, w, i, shared=shared)

        fns = {"experts": experts, "router": router, "layer": layer, "launch": lambda: flush[:1].zero_()}
        if sort_ok:
            def sort_experts(x=x, w=weights, i=ids):
                return sort_moe(x, w_gate_up, w_down, w, i, *shared)

            def sort_layer(x=x):
                w, i = moe_route(x, router_w, bias, s.spec)
                return sort_moe(x, w_gate_up, w_down, w, i, *shared)

            fns.update(sort_experts=sort_experts, sort_layer=sort_layer)
        if dg is not None:
            peer = DeepGemmMoE(dg, s.E, s.H, s.I, T, s.k, dev)
            psum = peer.layout(r_ids)[2]

            def dg_layer(x=x, peer=peer):
                return peer(x, w_gate_up, w_down, *moe_route(x, router_w, bias, s.spec), *shared)

            fns.update(dg_layer=dg_layer, dg_gemms=lambda peer=peer, psum=psum: peer.gemms(w_gate_up, w_down, psum))
        row = {"T": T, "unique_experts": ids.unique().numel(), "router_unique_experts": r_ids.unique().numel()}
        graphs, outs = {}, {}
        for name, fn in fns.items():
            try:
                graphs[name], outs[name] = capture(fn)
            except Exception as e:  # report, time the rest
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  T={T} {name}: {row[f'{name}_error']}", flush=True)
        for graph in graphs.values():  # a captured graph's outputs hold its results only once it has run
            graph.replay()
        torch.cuda.synchronize()
        # numbers: ours against the sort (both routings); against the torch reference at the first T
        checks = {}
        if "experts" in outs and "sort_experts" in outs:
            checks["experts_vs_sort"] = rel_err(outs["experts"], outs["sort_experts"])
        if "layer" in outs and "sort_layer" in outs:
            checks["layer_vs_sort"] = rel_err(outs["layer"], outs["sort_layer"])
        if "layer" in outs and "dg_layer" in outs:
            checks["layer_vs_deepgemm"] = rel_err(outs["layer"], outs["dg_layer"])
        if T == tokens[0] and "experts" in outs:
            checks["experts_vs_torch_reference"] = rel_err(
                outs["experts"], fused_moe_torch(x, w_gate_up, w_down, weights, ids, shared=shared))
        if "router" in outs:  # the graphed router chose what the eager call chose
            checks["router_ids_equal"] = float(torch.equal(outs["router"][1], r_ids))
        row["checks"] = checks
        bad = [k for k, v in checks.items() if (v != 1.0 if k == "router_ids_equal" else not v <= CHECK_TOL)]
        row["check"] = "FAIL" if bad else ("ok" if checks else "none")
        if bad:
            print(f"  T={T}: numerical check FAILED: {checks}", flush=True)
        t = time_graphs(graphs, reps, warmup, flush) if graphs else {}
        for name, us in t.items():
            row[f"{name}_us"] = us
        if T <= 128 and "router" in graphs:
            row["router_in_step_us"] = in_step_us(router, flush, reps, warmup)
        row.update({f"experts_{k}": v for k, v in floor_us(s, T, row["unique_experts"], copy_bw, gemm,
                                                          router=False).items()})
        row.update(floor_us(s, T, row["router_unique_experts"], copy_bw, gemm))
        if "layer_us" in row:
            row["floor_frac"] = row["floor_us"] / row["layer_us"]
            row["gemm_frac"] = layer_flops(s, T) / (row["layer_us"] * 1e-6) / gemm
            row["layer_TFLOPs"] = layer_flops(s, T) / (row["layer_us"] * 1e-6) / 1e12
        if "experts_us" in row:
            row["experts_floor_frac"] = row["experts_floor_us"] / row["experts_us"]
        if "layer_us" in row and "sort_layer_us" in row:
            row["speedup_vs_sort"] = row["sort_layer_us"] / row["layer_us"]
        if "dg_layer_us" in row:
            row["deepgemm_floor_frac"] = row["floor_us"] / row["dg_layer_us"]
        if "experts_us" in row and "sort_experts_us" in row:
            row["experts_speedup_vs_sort"] = row["sort_experts_us"] / row["experts_us"]
        row["pass"], row["miss"] = acceptance(key, row)
        res["rows"].append(row)
        print(f"  T={T}: " + ", ".join(f"{n} {row[f'{n}_us']:.1f} µs" for n in t)
              + f", floor {row['floor_us']:.1f} µs, check {row['check']}", flush=True)
        del graphs, outs, fns
        torch.cuda.empty_cache()
    return res


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except Exception:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    ap.add_argument("--reps", type=int, default=25, help="timed rounds (median), ≥ 20 for the official figures")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--commit", default=None, help="commit to record (default: the checkout's HEAD)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe needs a CUDA GPU")
    dev = torch.device("cuda")
    import triton

    copy_bw, gemm = copy_bandwidth(dev), gemm_rate(dev)
    sort_status = grouped_mm_status(dev)
    dg, dg_status = deepgemm_status(dev)
    result = {"device": torch.cuda.get_device_name(dev), "copy_GBps": copy_bw / 1e9, "gemm_TFLOPs": gemm / 1e12,
              "torch": torch.__version__, "triton": triton.__version__, "git_commit": args.commit or git_commit(),
              "sort_baseline": sort_status or "torch._grouped_mm",
              "deepgemm": dg_status or f"deep_gemm {getattr(dg, '__version__', '?')}",
              "timing": f"CUDA graph per candidate, median of {args.reps} interleaved replays after {args.warmup} "
                        "warm-up rounds, L2 flushed before each replay",
              "router_in_sort_layer": "specmla.ops.moe_route (the same router as ours)", "shapes": []}
    print(f"{result['device']}: copy {copy_bw / 1e9:.0f} GB/s (read + write), bf16 GEMM {gemm / 1e12:.0f} TFLOP/s; "
          f"torch {torch.__version__}, triton {triton.__version__}; sort baseline: {result['sort_baseline']}",
          flush=True)
    tables = []
    for key in args.shapes:
        s = SHAPES[key]
        res = bench_shape(key, s, sorted(set(args.tokens)), copy_bw, gemm, sort_status is None, args.reps,
                          args.warmup, dev, dg=dg)
        result["shapes"].append(res)
        tables.append(format_table(s, res["rows"]))
        print("\n" + tables[-1], flush=True)
        torch.cuda.empty_cache()
    print("\n" + "\n\n".join(tables))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_moe.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
