"""`specmla tune --check`: which of a model's kernel shapes run on measured configurations on a GPU, and which on the
rules (an untuned GPU, or shapes its tables do not hold).

For the device's "decode_routes" and "moe" tables (`ops.tuned`: the user's file, else the shipped one) it lists
the source and, for the model at one rank (no tensor or expert parallelism), the route keys (format, query
tokens, heads) and the fused-MoE GEMM shapes the tables cover and those left to the rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specmla.config import ModelConfig
from specmla.ops import tuned
from specmla.ops.moe.tuning import shape_key


@dataclass
class TableCheck:
    table: str
    source: str  # the file read, or "rules"
    covered: list[str] = field(default_factory=list)
    untuned: list[str] = field(default_factory=list)


def decode_keys(cfg: ModelConfig, kv_formats: list[str], query_tokens: list[int]) -> list[str]:
    """The decode route keys a model's calls look up: each format × query tokens (1, and 1 + k when speculating)
    at the model's heads."""
    return [f"{fmt},{s},{cfg.num_attention_heads}" for fmt in kv_formats for s in query_tokens]


def moe_keys(cfg: ModelConfig) -> list[str]:
    """The fused-MoE GEMM shapes a model's MoE layers look up ("up,E,I,H" and "down,E,H,I"; the float8 kinds for a
    checkpoint with FP8 weights); none for a model without routed experts."""
    if not cfg.n_routed_experts:
        return []
    E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    suffix = "_fp8" if cfg.quantization == "fp8" else ""
    return [shape_key("up" + suffix, E, I, H), shape_key("down" + suffix, E, H, I)]


def check(device_name: str, cfg: ModelConfig, kv_formats: list[str], query_tokens: list[int]) -> list[TableCheck]:
    key = tuned.device_key(device_name)
    out = []
    for table, keys, rows_of in (("decode_routes", decode_keys(cfg, kv_formats, query_tokens),
                                  lambda data: data.get("routes", {})),
                                 ("moe", moe_keys(cfg), lambda data: data)):
        path = tuned.source(table, key)
        rows = rows_of(tuned.load_file(path)) if path is not None else {}
        res = TableCheck(table, str(path) if path is not None else "rules")
        for k in keys:
            (res.covered if rows.get(k) else res.untuned).append(k)
        out.append(res)
    return out


def format_check(device_name: str, results: list[TableCheck]) -> str:
    lines = [f"device: {device_name} (tables keyed {tuned.device_key(device_name)}; "
             f"SPECMLA_TUNING={tuned.mode()}, user folder {tuned.user_dir()})"]
    for r in results:
        lines.append(f"{r.table}: {r.source}")
        if r.covered:
            lines.append(f"  measured: {', '.join(r.covered)}")
        if r.untuned:
            lines.append(f"  untuned (rules): {', '.join(r.untuned)}")
    untuned = sum(len(r.untuned) for r in results)
    lines.append("every shape measured" if not untuned else f"{untuned} shape(s) run on the rules on this device")
    return "\n".join(lines)
