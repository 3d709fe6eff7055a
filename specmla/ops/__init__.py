"""specmla's kernels. Each op is a public function with a torch reference beside it; the attention
ops, the mixture of experts and the FP8 linear live in packages (`decode`, `prefill`, `kv_cache`, `moe`,
`linear`), the others in
one file each."""

from specmla.ops.argmax import argmax_rows
from specmla.ops.decode import mla_decode
from specmla.ops.decode_prologue import mla_decode_prologue
from specmla.ops.kv_cache import decode_rows, gather_kv_cache, row_spec, write_kv_cache
from specmla.ops.linear import fp8_block_linear, head_matmul
from specmla.ops.moe import RouteSpec, fused_moe, fused_moe_torch, moe_route, moe_route_torch
from specmla.ops.ngram import ngram_propose
from specmla.ops.norm import rms_norm, rms_norm_pair
from specmla.ops.prefill import mla_prefill
from specmla.ops.rope import apply_rope, apply_rope_, apply_rope_qk_
from specmla.ops.sampling import SamplingTensors, apply_top_k_top_p, sample
from specmla.ops.spec_accept import accept_and_place, advance_spec_inputs, greedy_verify

__all__ = [
    "RouteSpec", "SamplingTensors", "accept_and_place", "advance_spec_inputs", "apply_rope", "apply_rope_",
    "apply_rope_qk_", "apply_top_k_top_p", "argmax_rows",
    "decode_rows", "fp8_block_linear", "fused_moe", "fused_moe_torch", "gather_kv_cache", "greedy_verify",
    "head_matmul", "mla_decode", "mla_decode_prologue", "mla_prefill",
    "moe_route", "moe_route_torch", "ngram_propose", "rms_norm", "rms_norm_pair", "row_spec", "sample",
    "write_kv_cache",
]
