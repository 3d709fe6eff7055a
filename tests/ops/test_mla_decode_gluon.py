"""The Hopper Gluon decode kernels (64-row tiles: the seesaw schedule for Dr = 64, the one-stream
kernel otherwise) against the fp64 reference.

Gluon does not run in the Triton interpreter, so on CPU the kernel is compiled for sm_90 with the
installed Triton (ptxas included) and its resources are checked; the GPU tests run it.
"""

import pytest
import torch
from helpers.mla_cases import assert_matches_reference, make_decode_case, rel_err
from helpers.offline_compile import offline_sm90_rows

from specmla.ops.decode.hopper import common as G
from specmla.ops.decode import mla_decode_torch
from specmla.ops.decode.triton import mla_decode_triton

SCALE = 0.0721
H100_SMEM = 227 * 1024


# ---------------------------------------------------------------- CPU -------------------------------------
CPU_COMPILE_CASES = [  # H, S, dc, dr, dtype, direct[, block_n]
    [128, 1, 512, 64, "bfloat16", True],  # H=128: one 64-head tile per program, written directly
    [16, 4, 512, 64, "bfloat16", False],  # four tokens folded into 64 rows, split partials
    [32, 2, 256, 32, "float16", False],  # other latent / rope widths, fp16: the one-stream kernel
    [128, 1, 512, 64, "bfloat16", False, 32],  # 32-key blocks: the one-stream kernel
    [16, 1, 512, 64, "fp8_ds_mla", True],  # an fp8 cache: keys as M, 16 rows (ops/mla_decode_gluon_quant.py)
    [16, 2, 512, 64, "fp8_ds_mla", False],  # ... 32 rows, split partials
    [16, 1, 512, 64, "tbq4", False],  # a tbq4 cache through the same kernel
]
FP8_STACK_BYTES = 256  # fp8, 32 rows: 112 B with Triton 3.6 (the GPU machine's), 192 B with 3.9; 16 rows: 0
SEESAW_STACK_BYTES = 256  # the seesaw warpgroups keep loop-invariant words on the stack (96 B with Triton 3.6, 232 B with 3.9)


def test_compiles_for_sm90_within_hopper_limits():
    """The kernel builds for sm_90 with this machine's Triton (ptxas included), without register
    spills, in an H100's shared memory. A fresh process: the suite's interpreter mode cannot compile."""
    if not G.HAVE_GLUON:
        pytest.fail("this Triton has no Gluon; the Hopper decode path would be missing")
    rows = offline_sm90_rows(CPU_COMPILE_CASES)
    assert [r["case"] for r in rows] == CPU_COMPILE_CASES
    for r in rows:
        (use,) = r["kernels"]
        fp8 = r["case"][4] in ("fp8_ds_mla", "tbq4")
        seesaw = r["case"][3] == 64 and len(r["case"]) == 6 and not fp8
        assert use["name"] == ("_mla_decode_quant_kernel" if fp8 else "_mla_decode_seesaw_kernel" if seesaw
                               else "_mla_decode_wgmma_kernel"), r
        # the kernel for quantised caches: two consumer warpgroups and a producer of 8 warps
        assert use["warps"] == (16 if fp8 else 8) and 0 < use["regs"] <= 255 and use["local"] == 0, r
        # no spills in the one-stream kernel; the seesaw kernel runs at the 255-register cap, the quantised-cache
        # kernel at its register split (SHAPES)
        assert use["stack"] <= (SEESAW_STACK_BYTES if seesaw else FP8_STACK_BYTES if fp8 else 0), r
        assert 0 < use["shared"] <= H100_SMEM, r


def test_seesaw_rule_padded_small_tiles_need_many_programs():
    """Which Gluon kernel a split runs: the seesaw for 64-row tiles and for 16/32-row tiles padded to
    64 rows once there are AUTO_MIN_PROGRAMS programs; the one-stream kernel for fewer (many short
    splits) and for shapes the seesaw does not take (measured, docs/benchmarks.md)."""
    from specmla.ops.decode.triton import plan
    cpu = torch.device("cpu")
    assert G.takes_seesaw(plan(64, 1, 128, 8192, cpu, 64), 64, 1, 512, 64, 64)  # 64-row tiles
    assert G.takes_seesaw(plan(1, 1, 64, 8192, cpu, 64), 1, 1, 512, 64, 64)  # ... even one program
    assert G.takes_seesaw(plan(32, 1, 16, 32768, cpu, 64), 32, 1, 512, 64, 64)  # 32 programs of 16 rows
    assert G.takes_seesaw(plan(32, 2, 16, 8192, cpu, 64), 32, 2, 512, 64, 64)  # 32 requests × 2 tokens, 32 rows
    assert not G.takes_seesaw(plan(4, 1, 16, 81920, cpu, 64), 4, 1, 512, 64, 64)  # few programs
    assert not G.takes_seesaw(plan(31, 1, 16, 8192, cpu, 64), 31, 1, 512, 64, 64)  # ... just below the rule
    assert not G.takes_seesaw(plan(4, 1, 64, 8192, cpu, 64), 4, 1, 256, 32, 64)  # Dr=32: one-stream only
    assert not G.takes_seesaw(plan(64, 2, 16, 8192, cpu, 64), 64, 2, 512, 64, 32)  # ... and 32-key blocks


def test_fp8_rule_takes_splits_of_two_blocks_or_more():
    """Which fp8 / tbq4 calls the Gluon kernels for quantised caches take by default (measured,
    docs/benchmarks.md)."""
    from specmla.ops.decode import triton as T
    from specmla.ops.decode.triton import plan
    cpu = torch.device("cpu")
    cfg = lambda B, S, T_: plan(B, S, 16, T_, cpu, 64, waves=1)  # noqa: E731
    assert T._quant_auto_takes(cfg(32, 2, 32768))  # two folded tokens: 32-row tiles
    assert T._quant_auto_takes(cfg(4, 1, 131072))  # few programs, long splits
    assert T._quant_auto_takes(cfg(32, 1, 32768))  # 32 programs of 16 rows
    assert T._quant_auto_takes(cfg(1, 1, 1024))  # two-block splits (plan's CPU stand-in has 8 SMs)
    assert not T._quant_auto_takes(cfg(1, 1, 512))  # one-block splits: Triton


def test_not_taken_on_cpu_and_clear_error_when_forced():
    q, kv, table, seq = make_decode_case(2, 1, 64, 64, 512, 64, [5, 70], torch.float32)
    assert not G.gluon_decode_supported(q, kv, 512, "auto", 64)
    with pytest.raises(ValueError, match="Gluon"):
        mla_decode_triton(q, kv, table, seq, SCALE, head_dim_v=512, gluon=True)


# ---------------------------------------------------------------- GPU -------------------------------------
def _check_gluon(case, causal, dc, num_splits=None, tol=1e-2):
    got, got_lse = mla_decode_triton(*case, SCALE, causal=causal, return_lse=True, head_dim_v=dc,
                                     num_splits=num_splits, gluon=True)
    assert_matches_reference(case, causal, dc, got, got_lse, tol)


GPU_CASES = [  # H, S, B, page, dc, dr, lens, causal, splits, dtype
    (128, 1, 3, 64, 512, 64, [1, 63, 4096], True, None, torch.bfloat16),
    (128, 2, 2, 16, 512, 64, [2, 1000], True, 5, torch.bfloat16),
    (16, 4, 6, 64, 512, 64, [4, 64, 65, 129, 1000, 4095], True, None, torch.bfloat16),
    (16, 4, 2, 1, 512, 64, [9, 130], True, 2, torch.bfloat16),  # one row per page
    (16, 4, 2, 128, 512, 64, [3, 2000], False, 7, torch.float16),
    (33, 2, 3, 64, 512, 64, [40, 500, 3000], True, 3, torch.bfloat16),  # padded head rows
    (64, 1, 2, 32, 256, 32, [77, 1025], True, None, torch.bfloat16),  # other widths
    (64, 1, 2, 64, 128, 16, [513, 1], False, 1, torch.float16),
    (16, 2, 2, 64, 512, 64, [300, 77], True, 3, torch.bfloat16),  # 32 folded rows, padded to 64
    (16, 1, 2, 16, 512, 64, [1, 2049], True, None, torch.bfloat16),  # 16 rows, padded to 64
]


@pytest.mark.gpu
@pytest.mark.parametrize("seesaw", [True, False], ids=["seesaw", "one_stream"])
@pytest.mark.parametrize("H,S,B,page,dc,dr,lens,causal,splits,dtype", GPU_CASES)
def test_gpu_gluon_matches_reference(H, S, B, page, dc, dr, lens, causal, splits, dtype, seesaw, monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.fail("the Gluon decode kernel targets Hopper (sm_90); run on the H100/H200")
    monkeypatch.setattr(G, "SEESAW", seesaw)
    case = make_decode_case(B, S, H, page, dc, dr, lens, dtype, device="cuda", seed=H + S + page)
    _check_gluon(case, causal, dc, splits)


@pytest.mark.gpu
def test_gpu_gluon_is_the_default_for_64_row_tiles():
    q, kv, table, seq = make_decode_case(2, 4, 16, 64, 512, 64, [300, 900], torch.bfloat16, device="cuda")
    assert G.gluon_decode_supported(q, kv, 512, "auto", 64)
    auto = mla_decode_triton(q, kv, table, seq, SCALE, head_dim_v=512)
    forced = mla_decode_triton(q, kv, table, seq, SCALE, head_dim_v=512, gluon=True)
    triton_only = mla_decode_triton(q, kv, table, seq, SCALE, head_dim_v=512, gluon=False)
    assert torch.equal(auto, forced)
    assert rel_err(auto, triton_only) <= 1e-2


@pytest.mark.gpu
def test_gpu_gluon_cuda_graph_capture_and_replay():
    B, S, H, T = 8, 1, 128, 700
    q, kv, table, seq = make_decode_case(B, S, H, 64, 512, 64, [T] * B, torch.bfloat16, device="cuda", seed=3)
    ns = 3
    ws = (torch.empty(B, S, H, ns, 512, device="cuda"), torch.empty(B, S, H, ns, device="cuda"))
    out = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
    mla_decode_triton(q, kv, table, seq, SCALE, out=out, workspace=ws, gluon=True)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_triton(q, kv, table, seq, SCALE, out=out, workspace=ws, gluon=True)
    for _ in range(3):
        seq.copy_(torch.randint(1, T + 1, (B,), dtype=torch.int32, device="cuda"))
        q.copy_(torch.randn_like(q))
        graph.replay()
        want = mla_decode_torch(q.double(), kv.double(), table, seq, SCALE, head_dim_v=512)
        assert rel_err(out, want) <= 1e-2

