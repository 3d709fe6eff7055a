"""Measured configurations of the ops, one JSON file per (table, device): the user's file first (`specmla tune`
writes it), then the file shipped in the package, then the op's rules.

Tables and their shipped folders:
- "decode_routes": `ops/decode/routes/<device>.json`, the decode kernel per (format, S, H) and (B, T) point;
- "moe": `ops/moe/configs/<device>.json`, the fused-MoE tile configurations per GEMM shape and token bucket;
- "fp8_linear": `ops/linear/configs/<device>.json`, the FP8 linear's launch knobs per weight shape and row bucket.

A device's key is its CUDA name with spaces and dashes as underscores (e.g. "NVIDIA_H200"). The user's folder is
$SPECMLA_TUNED, else $SPECMLA_CACHE/tuned, else ~/.cache/specmla/tuned, with one subfolder per table.
SPECMLA_TUNING chooses the sources: "auto" (default: user, shipped, rules), "shipped" (the user's files ignored),
"rules" (every file ignored: how an untuned GPU runs).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

OPS = Path(__file__).parent
SHIPPED = {"decode_routes": OPS / "decode" / "routes", "moe": OPS / "moe" / "configs",
           "fp8_linear": OPS / "linear" / "configs"}
SOURCES = ("auto", "shipped", "rules")


def device_key(name: str) -> str:
    """File stem of a device's tables, from its CUDA name."""
    return name.replace(" ", "_").replace("-", "_")


def cuda_device_key(device: torch.device) -> str | None:
    """The key of a CUDA device; None for any other device (no tables apply). Kernels look it up per call: the
    device's name is read once per index."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_key(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_key(index: int) -> str:
    return device_key(torch.cuda.get_device_name(index))


def user_dir() -> Path:
    if os.environ.get("SPECMLA_TUNED"):
        return Path(os.environ["SPECMLA_TUNED"])
    cache = os.environ.get("SPECMLA_CACHE")
    return (Path(cache) if cache else Path.home() / ".cache" / "specmla") / "tuned"


def user_file(table: str, key: str) -> Path:
    _check(table)
    return user_dir() / table / f"{key}.json"


def shipped_file(table: str, key: str) -> Path:
    _check(table)
    return SHIPPED[table] / f"{key}.json"


def mode() -> str:
    m = os.environ.get("SPECMLA_TUNING", "auto")
    if m not in SOURCES:
        raise ValueError(f"SPECMLA_TUNING={m!r}: expected one of {', '.join(SOURCES)}")
    return m


def source(table: str, key: str | None) -> Path | None:
    """The file a table of this device is read from (None: the rules). Looked up once per table, device and
    environment: a file another process writes is seen after `clear_cache()` (or a restart)."""
    if key is None:
        return None
    env = os.environ
    return _source(table, key, env.get("SPECMLA_TUNING"), env.get("SPECMLA_TUNED"), env.get("SPECMLA_CACHE"))


@functools.lru_cache(maxsize=None)
def _source(table: str, key: str, *environment) -> Path | None:
    m = mode()
    for path, used in ((user_file(table, key), m == "auto"), (shipped_file(table, key), m != "rules")):
        if used and path.is_file():
            return path
    return None


def load(table: str, key: str | None) -> dict:
    """The table of this device from its `source` ({} where the rules apply)."""
    path = source(table, key)
    return load_file(path) if path is not None else {}


@functools.lru_cache(maxsize=None)
def load_file(path: Path) -> dict:
    """A table file's contents, read once (until `clear_cache()`)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"tuned table {path} cannot be read ({e}); delete it or run `specmla tune` again") from e


_generation = [0]


def generation() -> int:
    """Changes whenever the tables may have: caches built on them key on it."""
    return _generation[0]


def clear_cache() -> None:
    """Forget which files were found and what they held (`write` calls it)."""
    _source.cache_clear()
    load_file.cache_clear()
    _generation[0] += 1


def write(table: str, key: str, data: dict, folder: Path | None = None) -> Path:
    """Write a table of this device to the user's folder (or `folder`, which holds one file per device)."""
    path = (Path(folder) / f"{key}.json") if folder is not None else user_file(table, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)  # readers see the old file or the new one, never half of one
    clear_cache()
    return path


def _check(table: str) -> None:
    if table not in SHIPPED:
        raise ValueError(f"unknown tuned table {table!r} ({', '.join(SHIPPED)})")
