"""A tensor-parallel server (`specmla serve --tp 2`, gloo ranks on CPU) never leaves a rank behind: SIGTERM stops
every rank; a worker rank that dies takes the server down (exit code 1) instead of leaving it waiting in a
collective; a rank 0 that dies takes its workers with it."""

import os
import signal
import time

import httpx
import pytest
from test_server import MODEL, start_server


def children(pid: int) -> list[int]:
    """Direct child processes of pid (Linux /proc)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            pass
    return out


def workers(pid: int) -> list[int]:
    """The spawned tensor-parallel ranks among pid's children (multiprocessing's resource tracker excluded)."""
    found = []
    for c in children(pid):
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except FileNotFoundError:
            continue
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            found.append(c)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.fixture
def tp_server(tiny_model_dir):
    proc, base, _ = start_server(tiny_model_dir, "--num-pages", "256", "--tp", "2", api_key=None)
    ranks = workers(proc.pid)
    assert len(ranks) == 1, ranks
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    yield proc, base, ranks
    for p in [proc.pid] + ranks:
        if alive(p):
            os.kill(p, signal.SIGKILL)
    proc.wait(timeout=30)


def test_sigterm_stops_every_rank(tp_server):
    proc, _, ranks = tp_server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
    assert "Traceback" not in proc.stderr.read()  # the stop reached the workers: no rank failed on its way out
    assert wait_gone(ranks) == []


def test_a_worker_that_dies_takes_the_server_down(tp_server):
    proc, _, ranks = tp_server
    os.kill(ranks[0], signal.SIGKILL)
    assert proc.wait(timeout=60) == 1
    assert "exited" in proc.stderr.read()


def test_a_rank_0_that_dies_takes_its_workers(tp_server):
    proc, _, ranks = tp_server
    proc.kill()
    proc.wait(timeout=30)
    assert wait_gone(ranks) == []
