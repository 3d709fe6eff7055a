"""specmla's kernels. Each op is a public function with a torch reference beside it; the attention
ops, the mixture of experts and the FP8 linear live in packages (`decode`, `prefill`, `kv_cache`, `moe`,
`linear`), the others in
one file each."""

from specmla.ops.decode import mla_decode
from specmla.ops.kv_cache import decode_rows, gather_kv_cache, row_spec, write_kv_cache
from specmla.ops.linear import fp8_block_linear
from specmla.ops.moe import RouteSpec, fused_moe, fused_moe_torch, moe_route, moe_route_torch
from specmla.ops.ngram import ngram_propose
from specmla.ops.norm import rms_norm, rms_norm_pair
from specmla.ops.prefill import mla_prefill
from specmla.ops.rope import apply_rope, apply_rope_, apply_rope_qk_
from specmla.ops.sampling import SamplingTensors, apply_top_k_top_p, sample
from specmla.ops.spec_accept import accept_and_place, advance_spec_inputs, greedy_verify

__all__ = [
    "RouteSpec", "SamplingTensors", "accept_and_place", "advance_spec_inputs", "apply_rope", "apply_rope_",
    "apply_rope_qk_",
    "apply_top_k_top_p",
    "decode_rows", "fp8_block_linear", "fused_moe", "fused_moe_torch", "gather_kv_cache", "greedy_verify",
    "mla_decode", "mla_prefill",
    "moe_route", "moe_route_torch", "ngram_propose", "rms_norm", "rms_norm_pair", "row_spec", "sample",
    "write_kv_cache",
]
