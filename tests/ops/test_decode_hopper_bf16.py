"""The Hopper decode kernels for 16-bit caches (`hopper.bf16`, the one-stream kernel, and `hopper.bf16_seesaw`)
against the fp64 reference.

Gluon does not run in the Triton interpreter, so on CPU each kernel is compiled for sm_90 with the installed
Triton (ptxas included) and its resources are checked; the GPU tests run it.
"""

import pytest
import torch
from helpers.decode_kernels import run_kernel
from helpers.mla_cases import assert_matches_reference, make_decode_case, rel_err
from helpers.offline_compile import offline_sm90_rows

from specmla.ops import mla_decode
from specmla.ops.decode import mla_decode_torch, route
from specmla.ops.decode.hopper import bf16, bf16_seesaw
from specmla.ops.decode.hopper import common as G

SCALE = 0.0721
H100_SMEM = 227 * 1024
KERNELS = {"bf16": bf16, "bf16_seesaw": bf16_seesaw}


# ---------------------------------------------------------------- CPU -------------------------------------
COMPILE_CASES = {  # kernel → cases: H, S, dc, dr, dtype, direct[, block_n]
    "bf16_seesaw": [
        [128, 1, 512, 64, "bfloat16", True],  # H=128: one 64-head tile per program, written directly
        [16, 4, 512, 64, "bfloat16", False],  # four tokens folded into 64 rows, split partials
        [16, 1, 512, 64, "bfloat16", False, 64, {"tma": True}],  # key blocks by TMA
    ],
    "bf16": [
        [16, 1, 512, 64, "bfloat16", False],  # 16 rows padded to 64
        [32, 2, 256, 32, "float16", False],  # other latent / rope widths, fp16
        [128, 1, 512, 64, "bfloat16", False, 32],  # 32-key blocks
    ],
}
# the seesaw warpgroups keep loop-invariant words on the stack (96 B with Triton 3.6, 232 B with 3.9)
SEESAW_STACK_BYTES = 256


@pytest.mark.parametrize("kernel", list(COMPILE_CASES))
def test_compiles_for_sm90_within_hopper_limits(kernel):
    """The kernel builds for sm_90 with this machine's Triton (ptxas included), in an H100's shared memory; the
    one-stream kernel without register spills, the seesaw kernel at the 255-register cap. A fresh process: the
    suite's interpreter mode cannot compile."""
    if not G.HAVE_GLUON:
        pytest.fail("this Triton has no Gluon; the Hopper decode path would be missing")
    rows = offline_sm90_rows(COMPILE_CASES[kernel], kernel)
    assert [r["case"] for r in rows] == COMPILE_CASES[kernel]
    seesaw = kernel == "bf16_seesaw"
    for r in rows:
        (use,) = r["kernels"]
        assert use["name"] == ("_mla_decode_seesaw_kernel" if seesaw else "_mla_decode_wgmma_kernel"), r
        assert use["warps"] == 8 and 0 < use["regs"] <= 255 and use["local"] == 0 and not use["wgmma_serialized"], r
        assert use["stack"] <= (SEESAW_STACK_BYTES if seesaw else 0), r
        assert 0 < use["shared"] <= H100_SMEM, r


def test_not_taken_on_cpu_and_clear_error_when_forced():
    q, kv, table, seq = make_decode_case(2, 1, 64, 64, 512, 64, [5, 70], torch.float32)
    assert not bf16.supported(q, kv, "bf16", 64, head_dim_v=512)
    assert not bf16_seesaw.supported(q, kv, "bf16", 64, head_dim_v=512)
    with pytest.raises(ValueError, match="no Hopper decode kernel"):
        mla_decode(q, kv, table, seq, SCALE, head_dim_v=512, backend="hopper")
    with pytest.raises(ValueError, match="no Hopper decode kernel 'bf16_seesaw'"):
        mla_decode(q, kv, table, seq, SCALE, head_dim_v=512, opts=bf16_seesaw.Options())


# ---------------------------------------------------------------- GPU -------------------------------------
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
# the seesaw kernel takes Dr = 64 and Dc a multiple of 128
KERNEL_CASES = [("bf16", c) for c in GPU_CASES] + [("bf16_seesaw", c) for c in GPU_CASES
                                                   if c[5] == 64 and c[4] % 128 == 0]
# with TMA key blocks: pages of whole 64-key blocks
KERNEL_CASES += [("bf16_seesaw_tma", c) for c in GPU_CASES if c[5] == 64 and c[4] % 128 == 0 and c[3] % 64 == 0]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,case", KERNEL_CASES)
def test_gpu_kernel_matches_reference(kernel, case):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.fail("the Gluon decode kernels target Hopper (sm_90); run on the H100/H200")
    H, S, B, page, dc, dr, lens, causal, splits, dtype = case
    args = make_decode_case(B, S, H, page, dc, dr, lens, dtype, device="cuda", seed=H + S + page)
    module = KERNELS[kernel.removesuffix("_tma")]
    # the seesaw kernel both ways: its key blocks by cp.async and by TMA
    opts = (module.Options(tma=kernel.endswith("_tma")) if kernel.startswith("bf16_seesaw") else module.Options())
    assert module.supported(args[0], args[1], "bf16", 64, opts, head_dim_v=dc)
    got, got_lse = run_kernel(module, *args, SCALE, kv_format="bf16", causal=causal, num_splits=splits,
                              max_rows=64, return_lse=True, head_dim_v=dc, opts=opts)
    assert_matches_reference(args, causal, dc, got, got_lse, 1e-2)


@pytest.mark.gpu
def test_gpu_hopper_is_the_default_for_64_row_tiles():
    q, kv, table, seq = make_decode_case(2, 4, 16, 64, 512, 64, [300, 900], torch.bfloat16, device="cuda")
    assert bf16.supported(q, kv, "auto", 64, head_dim_v=512)
    assert route(q, kv, table).kernel in ("bf16", "bf16_seesaw")  # which one: by split length (test_decode_dispatch)
    auto = mla_decode(q, kv, table, seq, SCALE, head_dim_v=512)
    forced = mla_decode(q, kv, table, seq, SCALE, head_dim_v=512, backend="hopper")
    triton_only = mla_decode(q, kv, table, seq, SCALE, head_dim_v=512, backend="triton")
    assert torch.equal(auto, forced)
    assert rel_err(auto, triton_only) <= 1e-2


@pytest.mark.gpu
def test_gpu_gluon_cuda_graph_capture_and_replay():
    B, S, H, T = 8, 1, 128, 700
    q, kv, table, seq = make_decode_case(B, S, H, 64, 512, 64, [T] * B, torch.bfloat16, device="cuda", seed=3)
    ns = 3
    ws = (torch.empty(B, S, H, ns, 512, device="cuda"), torch.empty(B, S, H, ns, device="cuda"))
    out = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
    mla_decode(q, kv, table, seq, SCALE, out=out, workspace=ws, backend="hopper")  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q, kv, table, seq, SCALE, out=out, workspace=ws, backend="hopper")
    for _ in range(3):
        seq.copy_(torch.randint(1, T + 1, (B,), dtype=torch.int32, device="cuda"))
        q.copy_(torch.randn_like(q))
        graph.replay()
        want = mla_decode_torch(q.double(), kv.double(), table, seq, SCALE, head_dim_v=512)
        assert rel_err(out, want) <= 1e-2
