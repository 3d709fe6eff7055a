"""Programmatic dependent launch (`ops.pdl`) in the decode step's Triton kernels.

Offline (no GPU): each kernel that takes a `PDL` constexpr, compiled for sm_90 with PDL on, holds
griddepcontrol.wait and griddepcontrol.launch_dependents in its PTX and touches global memory before the wait
only where that is allowed (the norms' constant weights); with PDL off neither instruction is there. The launch
keywords are off for CPU tensors and under the interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specmla.ops.pdl as pdl
from helpers.pdl_compile import KERNELS

ROOT = Path(__file__).resolve().parents[2]
CONSTANT_LOADS_FIRST = {"_rms_norm_kernel", "_rms_norm_pair_kernel", "_prologue_kernel"}  # a weight load before the wait


@pytest.fixture(scope="module")
def sm90_report() -> dict:
    """helpers/pdl_compile.py's report, from a fresh process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "pdl_compile.py")], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_waits_and_launches_dependents_on_sm90(sm90_report, name):
    row = sm90_report.get(name)
    assert row is not None, f"{name} was not compiled (launched: {sorted(sm90_report)})"
    assert row["wait"] and row["launch_dependents"], row
    if name in CONSTANT_LOADS_FIRST:
        assert all(op.startswith("ld.global") for op in row["before_wait"]), row
    else:
        assert row["before_wait"] == [], row  # no load, store or atomic ahead of the wait


def test_pdl_off_compiles_the_waits_out(sm90_report):
    row = sm90_report["plain:_rms_norm_kernel"]
    assert not row["wait"] and not row["launch_dependents"]


def test_pdl_args_are_off_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.pdl_args(torch.empty(1)) == {"PDL": False}
    if torch.cuda.is_available():  # a CUDA tensor under the interpreter: still off
        assert pdl.pdl_args(torch.empty(1, device="cuda")) == {"PDL": False}


@pytest.mark.parametrize("capability,on", [(90, True), (100, True), (80, False)])
def test_pdl_args_follow_the_compile_target(monkeypatch, capability, on):
    """Outside the interpreter a CPU tensor's kernel compiles for the active target (an offline build): PDL from
    sm_90 on."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from offline_sm90 import offline_sm90

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with offline_sm90(capability=capability):
        got = pdl.pdl_args(torch.empty(1))
    assert got == ({"PDL": True, "launch_pdl": True} if on else {"PDL": False})
