"""The server tests' shared fixture: one real server (uvicorn on loopback, `specmla serve`) per test module."""

import pytest
from test_server import start_server


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    proc, base, _ = start_server(tiny_model_dir, "--num-pages", "256", "--max-num-seqs", "16")
    yield base
    proc.terminate()
    proc.wait(timeout=30)
