"""`specmla tune`: measures a model's decode routes (per cache format and query tokens, `ops.decode.tune`),
fused-MoE tile configurations (`ops.moe.tune`) and, for a checkpoint with FP8 weights, the FP8 linear's launch knobs
(`ops.linear.tune`) on this GPU into the user's tables; with `--check`, which of a model's kernel shapes run on
measured configurations on a GPU, and which on the rules (an untuned GPU, or shapes its tables do not hold). Shapes
are the model's at one rank (no tensor or expert parallelism).

The check lists, for the device's "decode_routes", "moe" and "fp8_linear" tables (`ops.tuned`: the user's file, else
the shipped one), the file read and the route keys (format, query tokens, heads), fused-MoE GEMM shapes and FP8
linear weight shapes they cover and leave to the rules. A measurement merges into the user's table, which starts as a
copy of the shipped one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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
    E, _, H, I, _ = moe_shape(cfg)
    suffix = "_fp8" if cfg.quantization == "fp8" else ""
    return [shape_key("up" + suffix, E, I, H), shape_key("down" + suffix, E, H, I)]


def linear_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """The (N, K) weight shapes of a model's FP8 linear layers (every linear layer but the head and those DeepSeek's
    checkpoints keep or the loader turns into 16-bit weights, `model.fp8.NOT_QUANTISED`), from the model built on
    the meta device; none for a checkpoint without FP8 weights."""
    if cfg.quantization != "fp8":
        return []
    import torch
    from torch import nn

    from specmla.model.deepseek import DeepseekForCausalLM
    from specmla.model.fp8 import NOT_QUANTISED

    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg)
    shapes = {}
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and name != "lm_head" and last not in NOT_QUANTISED:
            shapes[(module.out_features, module.in_features)] = None
    return list(shapes)


def linear_keys(cfg: ModelConfig) -> list[str]:
    from specmla.ops.linear.tuning import shape_key

    return [shape_key(N, K) for N, K in linear_shapes(cfg)]


def check(device_name: str, cfg: ModelConfig, kv_formats: list[str], query_tokens: list[int]) -> list[TableCheck]:
    key = tuned.device_key(device_name)
    out = []
    tables = [("decode_routes", decode_keys(cfg, kv_formats, query_tokens), lambda data: data.get("routes", {})),
              ("moe", moe_keys(cfg), lambda data: data)]
    if cfg.quantization == "fp8":
        tables.append(("fp8_linear", linear_keys(cfg), lambda data: data))
    for table, keys, rows_of in tables:
        path = tuned.source(table, key)
        rows = rows_of(tuned.load(table, key))
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


def moe_shape(cfg: ModelConfig) -> tuple[int, int, int, int, int]:
    """(E, k, H, I, Is) of a model's MoE layers at one rank: Is = the shared experts' width (0: none). An FP8
    checkpoint's stacks hold each width padded to a multiple of 128 (`model.deepseek.MoE`): so do its shapes."""
    I = cfg.moe_intermediate_size
    Is = (cfg.n_shared_experts or 0) * I
    if cfg.quantization == "fp8":
        I, Is = -(-I // 128) * 128, -(-Is // 128) * 128
    return cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, I, Is


def tune_moe(cfg: ModelConfig, device, budget_s: float, out: str | None = None, key: str | None = None,
             timer_factory=None) -> list[Path]:
    """Search the model's fused-MoE configurations (its bf16 experts, or an FP8 checkpoint's e4m3 ones) on `device`
    (`ops.moe.tune`) and merge them into the user's "moe" table of this device (`key`, default the device's), which
    starts as a copy of the shipped one, so the shapes it held keep their rows; also into `out`/moe/. Returns the
    files written."""
    from tqdm import tqdm

    from specmla.ops.moe.tune import BUCKETS, merge_rows, tune_shape

    if not cfg.n_routed_experts:
        raise ValueError("the model has no routed experts: nothing to tune")
    key = key or tuned.cuda_device_key(device)
    with tqdm(total=len(BUCKETS), desc="moe buckets", unit="bucket") as bar:
        rows, _ = tune_shape(*moe_shape(cfg), BUCKETS, budget_s, device, timer_factory=timer_factory,
                             on_bucket=lambda row: bar.update(1), fp8=cfg.quantization == "fp8")
    table = _user_table("moe", key)
    for name, key_rows in rows.items():
        merge_rows(table, name, key_rows)
    return _write("moe", key, table, out)


def tune_decode(cfg: ModelConfig, device, formats: list[str], query_tokens: list[int], budget_s: float,
                out: str | None = None, key: str | None = None, measure=None, points=None) -> list[Path]:
    """Measure the model's decode routes on `device` (`ops.decode.tune.tune_routes`) and merge them into the user's
    "decode_routes" table of this device (`key`, default the device's; it starts as a copy of the shipped one, and
    each measured (format, S, H) replaces its rows); also into `out`/decode_routes/. Returns the files written."""
    import datetime

    import torch
    from tqdm import tqdm

    from specmla.ops.decode.tune import tune_routes

    device = torch.device(device)
    key = key or tuned.cuda_device_key(device)
    with tqdm(desc="decode points", unit="point") as bar:
        new = tune_routes(cfg.num_attention_heads, formats, query_tokens, device, budget_s, measure=measure,
                          on_point=bar.update, points=points)
    old = _user_table("decode_routes", key)
    data = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else key,
            "date": datetime.date.today().isoformat(), "command": "specmla tune",
            "routes": {**old.get("routes", {}), **new["routes"]}, "us": {**old.get("us", {}), **new["us"]}}
    return _write("decode_routes", key, data, out)


def tune_linear(cfg: ModelConfig, device, budget_s: float, out: str | None = None, key: str | None = None,
                timer_factory=None, sms: int | None = None) -> list[Path]:
    """Search the launch knobs of the model's FP8 linear layers on `device` (`ops.linear.tune`) into the user's
    "fp8_linear" table of this device (`key`, default the device's), which starts as a copy of the shipped one: each
    measured shape's rows replace that shape's; other shapes keep theirs. Also into `out`/fp8_linear/. Returns the
    files written."""
    import torch
    from tqdm import tqdm

    from specmla.ops.linear.tune import BUCKETS, tune_shapes

    shapes = linear_shapes(cfg)
    if not shapes:
        raise ValueError("the model's linear weights are not FP8: the fp8 search has nothing to tune")
    device = torch.device(device)
    key = key or tuned.cuda_device_key(device)
    with tqdm(total=len(shapes) * len(BUCKETS), desc="fp8 linear points", unit="point") as bar:
        rows, _ = tune_shapes(shapes, BUCKETS, budget_s, device, timer_factory=timer_factory, sms=sms,
                              on_bucket=lambda row: bar.update(1))
    table = _user_table("fp8_linear", key)
    for name, shape_rows in rows.items():
        table[name] = [[m, knobs] for m, knobs in sorted(shape_rows, key=lambda r: r[0])]
    return _write("fp8_linear", key, table, out)


def applicable_ops(cfg: ModelConfig, ops: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the ops of `ops` that have something to tune in this model, {op: why not} for the others)."""
    why = {"moe": None if cfg.n_routed_experts else "the model has no routed experts",
           "fp8": None if cfg.quantization == "fp8" else "the model's weights are not FP8"}
    return [op for op in ops if not why.get(op)], {op: why[op] for op in ops if why.get(op)}


def _user_table(table: str, key: str) -> dict:
    """A copy of the user's table of this device, else of the shipped one, else {}: what a measurement merges into,
    whatever SPECMLA_TUNING reads."""
    for path in (tuned.user_file(table, key), tuned.shipped_file(table, key)):
        if path.is_file():
            return dict(tuned.load_file(path))
    return {}


def _write(table: str, key: str, data: dict, out: str | None) -> list[Path]:
    """Write the table to the user's folder and, given `out`, to out/<table>/; returns the files."""
    written = [tuned.write(table, key, data)]
    if out is not None:
        written.append(tuned.write(table, key, data, folder=Path(out) / table))
    return written
