import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU every Triton kernel runs in the interpreter (must be set before triton.jit runs).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers/ as the package `helpers`

from helpers.tiny_config import TINY_TEST_CONFIG  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A small random model directory with a byte-level tokenizer (fast on CPU)."""
    from specmla.model.default import build_random_model_dir

    return build_random_model_dir(tmp_path_factory.mktemp("tiny") / "model", TINY_TEST_CONFIG, seed=0)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    os.environ["SPECMLA_CACHE"] = str(tmp_path_factory.mktemp("specmla_cache"))


@pytest.fixture
def tuned_tables(tmp_path, monkeypatch):
    """`ops.tuned` reading a user folder and shipped folders of the test's own (the package's stay untouched):
    returns (user folder, shipped folder); each table's shipped files go to shipped/<table>."""
    from specmla.ops import tuned

    user, shipped = tmp_path / "user", tmp_path / "shipped"
    monkeypatch.setenv("SPECMLA_TUNED", str(user))
    monkeypatch.delenv("SPECMLA_TUNING", raising=False)
    for table in list(tuned.SHIPPED):
        monkeypatch.setitem(tuned.SHIPPED, table, shipped / table)
    tuned.clear_cache()
    yield user, shipped
    tuned.clear_cache()
