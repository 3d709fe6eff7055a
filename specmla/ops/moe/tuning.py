"""Tile configurations of the fused-MoE GEMMs, shipped as data per device.

The device's "moe" table (`ops.tuned`: the user's file from `specmla tune`, else the shipped
`configs/<device>.json`, written by `specmla tune`) maps "up|down,E,N,K" to a list of
[max_tokens, config] rows in increasing max_tokens; a call takes the first row whose max_tokens
covers its token count. Shapes or devices without a file fall back to `default_config`, which
follows the same buckets: narrow row blocks and deep pipelines while the GEMMs stream weights,
128-row blocks once they are compute-bound. The float8 block-scaled GEMMs have kinds "up_fp8" and
"down_fp8" (block_k 128, one scale block per K step; "up_fp8" block_n 128, one quantisation group of
the intermediate per program) and fall back to `default_fp8_config`.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace

import torch

from specmla.ops import tuned


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def to_dict(self) -> dict:
        return asdict(self)


def default_config(kind: str, pairs: int) -> Config:
    """A configuration by the (token, expert) pairs a call routes (tokens · top_k; kind "up" or "down"): the
    tiles the measured tables (H100 and H200, V2-Lite's and V3's shapes) agree on at each size. 16-row blocks
    while the GEMMs stream weights, 32 and 64 rows in between, 128 rows with wide tiles once they multiply."""
    up = kind == "up"
    if pairs <= 256:
        return Config(16, 32, 128, 1, 4, 4) if up else Config(16, 64, 128, 1, 4, 4)
    if pairs <= 1024:
        return Config(32, 64, 128, 8, 4, 4) if up else Config(32, 128, 128, 8, 4, 4)
    if pairs <= 4096:
        return Config(64, 64, 128, 4, 4, 4) if up else Config(64, 128, 128, 8, 8, 4)
    return Config(128, 128, 64, 8, 8, 4) if up else Config(128, 256, 64, 8, 8, 4)


def default_fp8_config(kind: str, tokens_per_expert: float) -> Config:
    """A configuration of the float8 block-scaled GEMMs ("up_fp8", "down_fp8") by the mean rows per expert:
    16-row blocks with three or four stages of e4m3 weight tiles in flight while they stream weights (two
    gate_up programs fit one SM), 64-row blocks once they multiply (eight warps hold gate_up's two accumulators
    and the per-block products), 128 rows for the down projection at long prefills."""
    up = kind.startswith("up")
    if tokens_per_expert <= 8:
        return Config(16, 128, 128, 1, 4, 3) if up else Config(16, 128, 128, 1, 4, 4)
    if tokens_per_expert <= 48:
        return Config(32, 128, 128, 4, 4, 3) if up else Config(32, 128, 128, 4, 4, 4)
    return Config(64, 128, 128, 8, 8, 3) if up else Config(64, 128, 128, 8, 4, 4)


SHARED_MEMORY = 227 * 1024  # bytes of shared memory a program may hold on Hopper (the configurations' target)


@functools.lru_cache(maxsize=None)
def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may opt into on `device` (SHARED_MEMORY off CUDA)."""
    if device.type != "cuda":
        return SHARED_MEMORY
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def fit(cfg: Config, elem_bytes: int, b_tiles: int, limit: int = SHARED_MEMORY) -> Config:
    """cfg with fewer pipeline stages (then a shorter block_k) until its stages fit in `limit` bytes of
    shared memory: each stage holds the A tile [block_m, block_k] and b_tiles weight tiles [block_k, block_n]."""
    stages, bk = cfg.num_stages, cfg.block_k
    while stages * (cfg.block_m + b_tiles * cfg.block_n) * bk * elem_bytes > limit:
        if stages > 2:
            stages -= 1
        elif bk > 32:
            bk //= 2
        else:
            break
    return replace(cfg, num_stages=stages, block_k=bk)


def fit_fp8(cfg: Config, b_tiles: int, limit: int = SHARED_MEMORY) -> Config:
    """cfg with fewer pipeline stages (never below 2; block_k stays 128) until its e4m3 stages fit `limit`."""
    stages = cfg.num_stages
    while stages > 2 and stages * (cfg.block_m + b_tiles * cfg.block_n) * cfg.block_k > limit:
        stages -= 1
    return replace(cfg, num_stages=stages)


def _table(stem: str | None) -> dict:
    """The device's "moe" table (`ops.tuned`: the user's file, else the shipped one), as Configs."""
    return _as_configs(stem, tuned.generation())


@functools.lru_cache(maxsize=16)
def _as_configs(stem: str | None, generation: int) -> dict:
    return {key: [(int(m), Config(**cfg)) for m, cfg in rows] for key, rows in tuned.load("moe", stem).items()}


def shape_key(kind: str, E: int, N: int, K: int) -> str:
    return f"{kind},{E},{N},{K}"


def lookup(kind: str, E: int, N: int, K: int, tokens: int, device: torch.device, top_k: int = 8) -> Config:
    """The configuration for `kind` GEMMs of E experts, N output columns and K reduction, at `tokens`."""
    rows = _table(tuned.cuda_device_key(device)).get(shape_key(kind, E, N, K))
    if rows:
        for max_tokens, cfg in rows:
            if tokens <= max_tokens:
                return cfg
        return rows[-1][1]
    if kind.endswith("_fp8"):
        return default_fp8_config(kind, tokens * top_k / E)
    return default_config(kind, tokens * top_k)
