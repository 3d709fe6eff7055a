"""The decode route table (`ops.decode.dispatch`), on the CPU: which kernel takes which call."""

import json

import pytest

from specmla.ops import tuned
from specmla.ops.decode import dispatch
from specmla.ops.decode.dispatch import KERNELS, plan, row_tile, select_kernel

SMS = 132  # an H100


def hopper_supports(kv_format: str):
    """What the Hopper kernels take for a standard call (bf16 q, Dc = 512, Dr = 64, pages of 64, contiguous)."""
    def supports(kernel: str, block_m: int) -> bool:
        if kernel in ("bf16", "bf16_seesaw"):
            return kv_format in ("bf16", "fp16") and block_m <= 64
        if kernel == "fp8":
            return kv_format in ("fp8", "fp8_ds_mla") and block_m <= 16
        if kernel == "tbq4":
            return kv_format == "tbq4" and block_m <= 16
        if kernel == "dequant_seesaw":
            return kv_format in ("fp8", "fp8_ds_mla", "tbq4") and block_m <= 64
        if kernel == "fp8_folded":
            return kv_format in ("fp8", "fp8_ds_mla", "tbq4") and block_m <= 64
        assert kernel == "dequant"
        return kv_format in ("fp8_ds_mla", "tbq4") and block_m <= 32
    return supports


def pick(B, S, H, T, kv_format, hopper=True, **kw):
    return select_kernel(B, S, H, 576, kv_format, hopper=hopper, sm_count=SMS, max_seq=T, elem=2,
                         supports=hopper_supports(kv_format), **kw)


@pytest.mark.parametrize("B,S,H,T,kv_format,kernel", [
    (1, 1, 16, 8192, "bf16", "bf16"),  # one program: the one-stream kernel
    (32, 1, 16, 32768, "bf16", "bf16_seesaw"),  # splits of 8192 keys
    (1, 1, 128, 8192, "bf16", "bf16_seesaw"),  # two head blocks on 128-key splits
    (4, 1, 16, 8192, "bf16", "bf16"),  # 256-key splits
    (64, 4, 16, 8192, "fp16", "bf16_seesaw"),  # four tokens folded into 64 rows
    (32, 1, 16, 32768, "fp8", "fp8"),
    (32, 1, 16, 32768, "fp8_ds_mla", "fp8"),
    (32, 1, 16, 32768, "tbq4", "tbq4"),
    (32, 4, 16, 32768, "tbq4", "fp8_folded"),  # S > 1: the tokens folded into 64 rows, the codes read once
    (32, 2, 16, 32768, "fp8", "fp8_folded"),  # two tokens folded on splits of 8192 keys
    (16, 2, 16, 8192, "fp8", "fp8"),  # two tokens on 1024-key splits: one per program (2048 needed at S = 2)
    (32, 3, 16, 32768, "fp8_ds_mla", "fp8_folded"),  # 48 rows; fp8 formats fold onto e4m3 scores
    (8, 4, 16, 32768, "fp8", "fp8_folded"),  # folded splits of 2048 keys
    (4, 4, 16, 8192, "fp8", "fp8"),  # folded splits of 256 keys: one token per program
    (8, 3, 16, 16384, "fp8", "fp8_folded"),  # folded 48 of 64 rows on 1024-key splits
    (8, 3, 16, 8192, "fp8", "fp8"),  # on 512-key splits: one token per program
    (8, 3, 16, 32768, "fp8", "fp8_folded"),
    (32, 5, 16, 32768, "fp8", "fp8"),  # five tokens of 16 heads: one token per 64-row tile would fold nothing
    (32, 3, 32, 32768, "tbq4", "dequant"),  # three tokens of 32 heads: likewise, 32 rows on dequant
    (8, 1, 32, 16384, "fp8_ds_mla", "dequant"),  # 32 rows
    (8, 1, 32, 16384, "tbq4", "dequant"),
    (8, 1, 32, 16384, "fp8", "dequant_seesaw"),  # the fp8 kernel takes 16 rows only, and dequant no 608-byte rows
    (4, 1, 64, 16384, "tbq4", "dequant_seesaw"),  # 64 rows
    (128, 1, 16, 64, "fp8", "triton"),  # one-block splits: the Triton kernel
    (1, 4, 4, 131072, "tbq4", "tbq4"),  # 4 tokens × 4 heads: folded into the 16-row kernel's own rows
    (1, 4, 4, 131072, "fp8", "fp8"),
    (1, 4, 16, 4096, "tbq4", "tbq4"),  # folded splits too short, one token per program's long enough: 16 rows
    (4, 2, 16, 2048, "fp8", "fp8"),
    (1, 4, 16, 256, "tbq4", "tbq4"),  # one-block splits: tbq4's Triton kernel is slower still, 16 rows per token
    (1, 4, 16, 256, "fp8_ds_mla", "fp8"),  # S > 1 on one-block splits: the 16-row kernel, one token a program
    (1, 1, 16, 256, "fp8_ds_mla", "triton"),  # S = 1 on one-block splits: Triton
    (1, 1, 16, 8192, "tbq4", "tbq4"),
    (1, 1, 16, 8192, "fp8", "triton"),
    (1, 2, 32, 2048, "fp8", "triton"),  # S > 1 above 16 heads on one-block splits: no 16-row kernel, Triton
    (1, 4, 32, 2048, "fp8_ds_mla", "triton"),
    (4, 1, 16, 4096, "fp32", "triton"),
])
def test_route_table(B, S, H, T, kv_format, kernel):
    route = pick(B, S, H, T, kv_format)
    assert route.kernel == kernel
    assert route.plan["BLOCK_M"] <= 64 and route.plan["num_splits"] >= 1
    if kernel in ("fp8", "tbq4"):
        assert route.plan["BLOCK_M"] == 16 and route.plan["BLOCK_N"] == 64
    if kernel in dispatch.FOLD_KERNELS:  # every token of the call in one program per head block
        assert route.plan["FOLD"] * route.plan["BLOCK_H"] >= min(S * H, 64) and route.plan["BLOCK_N"] == 64
    if kernel != "triton":  # Hopper kernels run one wave of programs
        assert route.plan["num_splits"] == plan(B, S, H, T, SMS, route.plan["BLOCK_N"],
                                                16 if kernel in ("fp8", "tbq4") else 64, waves=1)["num_splits"]


@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "fp8_ds_mla", "tbq4"])
def test_no_hopper_or_triton_backend_takes_the_triton_kernel(kv_format):
    assert pick(32, 1, 16, 32768, kv_format, hopper=False).kernel == "triton"
    assert pick(32, 1, 16, 32768, kv_format, backend="triton").kernel == "triton"
    route = pick(32, 1, 16, 32768, kv_format, backend="triton")
    assert route.tiles == dict(dispatch.default_tiles(16, 576, 2, kv_format))


def test_hopper_backend_forces_a_hopper_kernel_or_raises():
    # fp8 short splits at S = 1: auto leaves them to Triton, "hopper" takes a Hopper kernel
    assert pick(1, 1, 16, 256, "fp8_ds_mla").kernel == "triton"
    route = pick(1, 1, 16, 256, "fp8_ds_mla", backend="hopper")
    assert route.kernel == "fp8" and route.plan["BLOCK_M"] == 16
    route = pick(1, 4, 16, 256, "tbq4", kernel="dequant_seesaw")  # named: the tokens folded
    assert route.kernel == "dequant_seesaw" and route.plan["BLOCK_M"] == 64
    route = pick(1, 4, 16, 256, "tbq4", kernel="tbq4")  # named: one token per program on the 16-row kernel
    assert route.kernel == "tbq4" and route.plan["BLOCK_M"] == 16
    with pytest.raises(ValueError, match="no Hopper decode kernel"):
        pick(8, 1, 16, 16384, "fp32", backend="hopper")  # no Hopper kernel reads fp32 rows
    with pytest.raises(ValueError, match="no Hopper decode kernel"):
        pick(8, 1, 16, 16384, "bf16", hopper=False, backend="hopper")


def test_a_named_kernel_runs_or_raises():
    route = pick(32, 2, 16, 32768, "fp8_ds_mla", kernel="dequant")  # two tokens folded into 32 rows
    assert route.kernel == "dequant" and route.plan["BLOCK_M"] == 32
    assert pick(1, 1, 16, 8192, "bf16", kernel="bf16_seesaw").kernel == "bf16_seesaw"
    assert pick(32, 1, 16, 32768, "bf16", kernel="bf16").kernel == "bf16"
    assert pick(32, 1, 16, 32768, "bf16", kernel="triton").kernel == "triton"
    with pytest.raises(ValueError, match="no Hopper decode kernel 'fp8'"):
        pick(32, 1, 16, 32768, "bf16", kernel="fp8")
    with pytest.raises(ValueError, match="unknown kernel"):
        pick(32, 1, 16, 32768, "bf16", kernel="flashmla")
    with pytest.raises(ValueError, match="unknown backend"):
        pick(32, 1, 16, 32768, "bf16", backend="cuda")


def test_every_kernel_is_reachable():
    seen = {pick(B, S, H, T, fmt).kernel for B, S, H, T, fmt in [
        (1, 1, 16, 8192, "bf16"), (32, 1, 16, 32768, "bf16"), (8, 1, 32, 16384, "tbq4"),
        (32, 1, 16, 32768, "fp8"), (32, 1, 16, 32768, "tbq4"), (4, 1, 16, 4096, "fp32"), (32, 4, 16, 32768, "fp8"),
        (4, 1, 64, 16384, "tbq4")]}
    assert seen == set(KERNELS)


ROUTES = {"tbq4,4,16": [[32, 32768, "tbq4"], [1, 262144, "dequant_seesaw"], [1, 8192, "triton"]],
          "fp8,1,64": [[4, 16384, "triton"]], "tbq4,1,16": [[1, 8192, "dequant"], [32, 32768, "tbq4"]],
          "tbq4,3,16": [[1, 8192, "tbq4"]]}


@pytest.mark.parametrize("B,S,H,T,kv_format,kernel", [
    (32, 4, 16, 32768, "tbq4", "tbq4"),  # a measured point
    (16, 4, 16, 65536, "tbq4", "tbq4"),  # nearest: (32, 32k)
    (1, 4, 16, 131072, "tbq4", "dequant_seesaw"),  # nearest: (1, 256k)
    (2, 4, 16, 4096, "tbq4", "triton"),  # nearest: (1, 8k)
    (32, 2, 16, 32768, "tbq4", "fp8_folded"),  # S = 2 not measured: the rules
    (4, 1, 64, 16384, "fp8", "triton"),
    (4, 1, 64, 16384, "fp8_ds_mla", "dequant_seesaw"),  # another format: the rules
    (1, 1, 16, 8192, "tbq4", "dequant"),  # measured on one-block splits (the rules would take tbq4): taken
    (1, 1, 16, 4096, "tbq4", "dequant"),  # nearest: the same point, splits as short
    (1, 3, 16, 8192, "tbq4", "tbq4"),  # measured one token per program on 192-key splits
    (1, 3, 16, 2048, "tbq4", "tbq4"),  # nearest that point, on shorter splits than measured: tbq4 takes any
])
def test_measured_routes_take_the_nearest_point(B, S, H, T, kv_format, kernel):
    assert pick(B, S, H, T, kv_format, routes=ROUTES).kernel == kernel


def test_no_measured_point_without_requests_or_keys():
    assert dispatch.measured_kernel(ROUTES, "tbq4", 1, 1, 16, 8192) == "dequant"
    assert dispatch.measured_kernel(ROUTES, "tbq4", 0, 1, 16, 8192) is None  # no request
    assert dispatch.measured_kernel(ROUTES, "tbq4", 1, 1, 16, 0) is None  # an empty block table


def test_measured_routes_yield_to_what_the_call_allows():
    # a kernel that does not take the tensors, a GPU without the Hopper kernels, a named kernel or backend: the rules
    def no_tbq4(kernel, block_m):
        return kernel != "tbq4" and hopper_supports("tbq4")(kernel, block_m)

    route = select_kernel(32, 4, 16, 576, "tbq4", hopper=True, sm_count=SMS, max_seq=32768, elem=2,
                          supports=no_tbq4, routes=ROUTES)
    assert route.kernel == "fp8_folded"
    assert pick(32, 4, 16, 32768, "tbq4", hopper=False, routes=ROUTES).kernel == "triton"
    assert pick(32, 4, 16, 32768, "tbq4", kernel="dequant_seesaw", routes=ROUTES).kernel == "dequant_seesaw"
    assert pick(32, 4, 16, 32768, "tbq4", backend="triton", routes=ROUTES).kernel == "triton"
    route = pick(32, 4, 16, 32768, "tbq4", routes=ROUTES)  # the measured kernel keeps its plan: one token per program
    assert route.kernel == "tbq4" and route.plan["BLOCK_M"] == 16
    # a measured fp8 Hopper kernel far from the call, whose splits would be one block at S = 1: the rules (Triton)
    measured = {"fp8_ds_mla,1,32": [[32, 32768, "dequant"]]}
    assert pick(1, 1, 32, 256, "fp8_ds_mla", routes=measured).kernel == "triton"
    assert pick(32, 1, 32, 32768, "fp8_ds_mla", routes=measured).kernel == "dequant"


def test_measured_routes_on_disk_name_known_kernels():
    """Every shipped routes file names known kernels at positive B and T, keyed by format, S and H."""
    files = list(tuned.SHIPPED["decode_routes"].glob("*.json"))
    for path in files:
        table = json.loads(path.read_text())["routes"]
        for key, rows in table.items():
            fmt, S, H = key.split(",")
            assert int(S) >= 1 and int(H) >= 1 and fmt in ("bf16", "fp16", "fp8", "fp8_ds_mla", "tbq4"), key
            assert all(r[0] >= 1 and r[1] >= 1 and r[2] in KERNELS for r in rows), key


@pytest.mark.parametrize("path", sorted(tuned.SHIPPED["decode_routes"].glob("*.json")), ids=lambda p: p.stem)
def test_rules_stay_near_every_measured_point(path):
    """An untuned Hopper runs on the rules: at every point a shipped table measured (each kernel's µs at its own
    plan), the kernel the rules pick takes at most 1.06x the fastest one's time. A kernel newer than a table's key
    (timed at none of its points) is not judged there; one the key timed anywhere must be timed everywhere."""
    evidence = json.loads(path.read_text())["us"]
    worst = []
    for key, points in evidence.items():
        fmt, S, H = key.split(",")
        timed = {k for _, _, times in points for k in times}
        for B, T, times in points:
            route = pick(B, int(S), int(H), T, fmt)
            plain = {k: t for k, t in times.items() if "@" not in k}  # kernels at their own plan
            if route.kernel not in timed:
                continue
            assert route.kernel in plain, (key, B, T, route.kernel)
            worst.append((plain[route.kernel] / min(plain.values()), key, B, T, route.kernel))
    assert len(worst) >= 10
    assert max(worst)[0] <= 1.06, sorted(worst, reverse=True)[:3]


def test_plan_and_tiles():
    assert row_tile(4, 16) == 64 and row_tile(4, 16, 16) == 16 and row_tile(1, 3) == 16 and row_tile(2, 128) == 64
    p1 = plan(1, 1, 16, 81920, SMS)
    assert p1["num_splits"] > 1  # B=1 is split to fill the GPU
    assert plan(128, 1, 16, 4096, SMS)["num_splits"] <= p1["num_splits"]
    assert plan(1, 1, 16, 64, SMS, block_n=64)["num_splits"] == 1  # at least one key block per split
    # the Triton kernel's pipeline shrinks to the shared-memory budget: fp32 rows of 576
    t = dispatch.default_tiles(64, 576, 4)
    assert t["num_stages"] * t["block_n"] * 576 * 4 + 64 * 576 * 4 <= dispatch.SMEM_BUDGET
