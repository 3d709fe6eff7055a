"""Compile kernels for sm_90 on this machine through `scripts/offline_sm90.py`, in a fresh process (the test suite
runs Triton's interpreter, which cannot compile), and return its JSON report: one row per case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def offline_sm90_rows(cases: list, mode: str | None = None) -> list[dict]:
    """The report of `offline_sm90.py [mode] CASES` (mode "prefill": the prefill kernel; none: the decode ones)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, str(root / "scripts" / "offline_sm90.py"), *([mode] if mode else []), json.dumps(cases)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
