"""GPU time of a candidate launch configuration, as the searches of `specmla tune` measure it (`ops.moe.tune`,
`ops.linear.tune`): the calls captured once in one CUDA graph, each on its own inputs (so weights are not re-read
from L2), the graph replayed after a spin kernel that hides its launch; the median per call over the replays."""

from __future__ import annotations

import logging
import statistics

import torch

log = logging.getLogger("specmla.tune")
SPIN_CYCLES = 200_000  # about 0.1 ms: the GPU spins while the host launches the timed replay


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work where it runs asynchronously (CUDA); a no-op on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_call_time(call, n: int, reps: int, what: str = "") -> float | None:
    """Median seconds per call of `call(i)` for i in range(n), one CUDA graph replayed `reps` times; None where the
    configuration does not compile or launch here (`what` names it in the debug log). An illegal memory access is
    raised: the CUDA context is gone and nothing further can run."""
    try:
        call(0)  # compiles; raises OutOfResources and the like outside any capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n):
                call(i)
        graph.replay()
        times = []
        for _ in range(reps):
            torch.cuda._sleep(SPIN_CYCLES)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3 / n)
        del graph
        return statistics.median(times)
    except Exception as e:
        if "illegal" in str(e).lower():
            raise
        log.debug("skip %s: %s: %s", what, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        torch.cuda.synchronize()
        return None
