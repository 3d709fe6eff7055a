"""Programmatic dependent launch (PDL) for the decode step's Triton kernels, on Hopper and later GPUs.

A kernel launched with PDL may start while its predecessor on the stream is still running: its programs
load what no earlier kernel writes (weights, tables) and then `wait` until the predecessor has finished
and its writes are visible; the predecessor's `launch_dependents` lets that start happen before its own
end. In a CUDA graph of a few hundred small kernels this hides each launch and each kernel's first
weight loads behind the previous kernel's tail.

Rules every kernel that takes a `PDL` constexpr keeps:
- `wait(PDL)` runs in every program, before the first load of anything an earlier kernel writes and
  before the first store (a predecessor may still read what this kernel overwrites);
- `launch_dependents(PDL)` may come anywhere (right after the wait here): the dependents still wait for
  this whole grid to finish before they touch its output.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def _device_takes_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _target_takes_pdl() -> bool:
    """Whether the active Triton target (where a kernel on a CPU tensor compiles: an offline sm_90 build) is a CUDA
    GPU of compute capability 9.0 or later."""
    try:
        target = triton.runtime.driver.active.get_current_target()
    except Exception:  # no GPU driver: nothing to compile for
        return False
    return target.backend == "cuda" and target.arch >= 90


def pdl_args(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel with a `PDL` constexpr, on t's device: PDL on CUDA devices of compute
    capability 9.0 and later, else a plain launch with the waits compiled out; never under the interpreter. (A
    Triton kernel meets a CPU tensor only in the interpreter, or in a compile for the active target.)"""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return {"PDL": False}
    if t.is_cuda:
        on = _device_takes_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device())
    else:
        on = _target_takes_pdl()
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the kernels before this one on the stream have finished (their writes visible)."""
    if PDL:
        gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel on the stream start its programs (they still `wait` for this grid to finish)."""
    if PDL:
        gdc_launch_dependents()
