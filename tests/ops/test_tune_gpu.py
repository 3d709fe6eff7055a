"""`specmla tune`'s measurements on the GPU: the decode kernels' times at a point, a short MoE search, and the tables
they write change kernels and tiles, never results (against the torch references)."""

import pytest
import torch
from helpers.moe_cases import fro_err, make_moe_case

from specmla.ops import fused_moe_torch, mla_decode, tuned
from specmla.ops.decode import mla_decode_torch, route
from specmla.ops.decode.tune import ROUTE_CANDIDATES, SCALE, kernel_times, make_problem
from specmla.ops.moe.triton import fused_moe_triton
from specmla.ops.moe.tune import tune_shape

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv", ["bf16", "fp8", "tbq4"])
def test_every_kernel_a_route_may_name_gives_the_reference(kv, tuned_tables):
    """Each candidate kernel that takes a call is timed; a user's table naming it routes the call to it, and its
    output equals the fp32 reference within the format's tolerance. The e4m3 tensor-core kernels ("fp8", "tbq4":
    Q, P and the codes rounded to e4m3) are held to their design instead: their error against the reference is the
    e4m3 emulation's (`mla_decode_e4m3`; tbq4's one-term e4m3 P gives ~6 % on these random latents)."""
    from specmla.ops.decode.hopper.e4m3_reference import mla_decode_e4m3

    B, T, S, H = 4, 2048, 1, 16
    times = kernel_times(kv, H, B, T, S, torch.device("cuda"))
    assert times and all(t > 0 for t in times.values()) and set(times) <= set(ROUTE_CANDIDATES[kv])
    caches, table, seq, qs = make_problem(H, B, T, S, 1, kv)
    want = mla_decode_torch(qs[0].float(), caches[0], table, seq, SCALE, head_dim_v=512, kv_format=kv)
    key = tuned.cuda_device_key(torch.device("cuda"))
    for kernel in times:
        tuned.write("decode_routes", key, {"routes": {f"{kv},{S},{H}": [[B, T, kernel]]}})
        assert route(qs[0], caches[0], table, kv_format=kv, head_dim_v=512).kernel == kernel
        got = mla_decode(qs[0], caches[0], table, seq, SCALE, head_dim_v=512, kv_format=kv)
        assert torch.isfinite(got).all(), kernel
        err = ((got.float() - want).norm() / want.norm()).item()
        if kernel in ("fp8", "tbq4"):
            emu = mla_decode_e4m3(qs[0].cpu(), caches[0].cpu(), table.cpu(), seq.cpu(), SCALE, kv_format=kv,
                                  head_dim_v=512)
            e_emu = ((emu.float() - want.cpu()).norm() / want.cpu().norm()).item()
            assert abs(err - e_emu) <= 0.25 * e_emu, (kernel, err, e_emu)
        else:
            assert err <= (2e-2 if kv == "bf16" else 3e-2), (kernel, err)


def test_a_short_moe_search_gives_configurations_that_match_the_reference():
    E, k, H, I, Is = 8, 2, 256, 128, 128
    rows, report = tune_shape(E, k, H, I, Is, [1, 64], budget_s=20, device=torch.device("cuda"))
    assert [r["T"] for r in report] == [1, 64] and all(r["us"] > 0 for r in report)
    for T, ((_, up), (_, down)) in zip((1, 64), zip(rows[f"up,{E},{I},{H}"], rows[f"down,{E},{H},{I}"])):
        case = make_moe_case(T, E, k, H, I, Is, torch.bfloat16, seed=T, device="cuda")
        with torch.inference_mode():
            want = fused_moe_torch(*case.args, shared=case.shared)
            got = fused_moe_triton(*case.args, shared=case.shared, up_config=up, down_config=down)
        assert fro_err(got, want) <= 1e-2


def test_a_short_fp8_linear_search_gives_knobs_that_match_the_reference(tuned_tables):
    """The search on the GPU at a split-K and a GEMM bucket; the table it makes routes calls to its knobs, whose
    outputs equal the torch reference (and the rules' output) within the kernels' tolerance."""
    from specmla.ops.linear import fp8_block_linear_torch, fp8_block_linear_triton, tuning, weight_quant
    from specmla.ops.linear.tune import tune_shapes

    N, K = 2112, 7168
    dev = torch.device("cuda")
    rows, report = tune_shapes([(N, K)], [4, 256], 20.0, dev)
    assert [r["M"] for r in report] == [4, 256] and all(r["us"] > 0 for r in report)
    w, s = weight_quant(torch.randn(N, K, device=dev) * 0.05)
    xs = {M: torch.randn(M, K, device=dev, dtype=torch.bfloat16) for M in (3, 200)}
    by_rules = {M: fp8_block_linear_triton(x, w, s).float() for M, x in xs.items()}  # no table yet
    key = tuned.cuda_device_key(dev)
    tuned.write("fp8_linear", key, {tuning.shape_key(N, K): [[m, knobs] for m, knobs in rows[f"{N},{K}"]]})
    for M, x in xs.items():
        assert tuning.lookup(N, K, M, dev) == dict(rows[f"{N},{K}"][0 if M <= 4 else 1][1])
        got = fp8_block_linear_triton(x, w, s).float()
        assert ((got - by_rules[M]).norm() / by_rules[M].norm()).item() <= 1e-2  # K order and bf16 rounding
        want = fp8_block_linear_torch(x.float(), w, s)
        assert ((got - want).norm() / want.norm()).item() <= 3e-2


def test_a_short_fp8_moe_search_gives_configurations_that_match_the_rules(tuned_tables):
    """The fp8 experts' search at two buckets: its tiles give the rules' output up to the fp32 summation order, and
    the unquantised reference within the w8a8 tolerance (test_fused_moe_fp8's ACT_TOL)."""
    from specmla.ops.linear.reference import weight_dequant
    from specmla.ops.moe.triton import fused_moe_fp8_triton
    from specmla.ops.moe.tune import _quantised

    E, k, H, I, Is = 8, 2, 256, 128, 128
    dev = torch.device("cuda")
    rows, report = tune_shape(E, k, H, I, Is, [1, 64], budget_s=20, device=dev, fp8=True)
    assert [r["T"] for r in report] == [1, 64] and all(r["us"] > 0 and r["fp8"] for r in report)
    g = torch.Generator(device=dev).manual_seed(5)
    (gu, gu_s), (dn, dn_s) = (_quantised(torch.randn(*shape, device=dev, generator=g) / shape[-1] ** 0.5)
                              for shape in ((E, 2 * I, H), (E, H, I)))
    (sgu, sgu_s), (sd, sd_s) = (_quantised(torch.randn(*shape, device=dev, generator=g) / shape[-1] ** 0.5)
                                for shape in ((2 * Is, H), (H, Is)))
    kw = dict(shared=(sgu, sd), w_gate_up_scale=gu_s, w_down_scale=dn_s, shared_scales=(sgu_s, sd_s))
    deq = [weight_dequant(w, s) for w, s in ((sgu, sgu_s), (sd, sd_s))]
    for T, ((_, up), (_, down)) in zip((1, 64), zip(rows[f"up_fp8,{E},{I},{H}"], rows[f"down_fp8,{E},{H},{I}"])):
        x = torch.randn(T, H, device=dev, generator=g, dtype=torch.bfloat16)
        w = torch.randn(T, k, device=dev, generator=g).softmax(-1)
        ids = torch.rand(T, E, device=dev, generator=g).topk(k, dim=1).indices
        got = fused_moe_fp8_triton(x, gu, dn, w, ids, up_config=up, down_config=down, **kw)
        rules = fused_moe_fp8_triton(x, gu, dn, w, ids, **kw)
        assert fro_err(got, rules) <= 1.5e-2
        want = fused_moe_torch(x.float(), torch.stack([weight_dequant(a, b) for a, b in zip(gu, gu_s)]),
                               torch.stack([weight_dequant(a, b) for a, b in zip(dn, dn_s)]), w, ids,
                               shared=tuple(deq))
        assert fro_err(got.float(), want) <= 7e-2
