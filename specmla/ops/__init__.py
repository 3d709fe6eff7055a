"""specmla's kernels. Each op is a public function with a torch reference beside it; the attention
ops live in packages (`decode`, `prefill`, `kv_cache`), the others in one file each."""

from specmla.ops.decode import mla_decode
from specmla.ops.kv_cache import gather_kv_cache, write_kv_cache
from specmla.ops.moe import moe_experts_torch, moe_experts_triton, moe_route
from specmla.ops.ngram import ngram_propose
from specmla.ops.norm import rms_norm, rms_norm_pair
from specmla.ops.prefill import mla_prefill
from specmla.ops.rope import apply_rope, apply_rope_
from specmla.ops.sampling import sample
from specmla.ops.spec_accept import accept_and_place, greedy_verify

__all__ = [
    "accept_and_place", "apply_rope", "apply_rope_", "gather_kv_cache", "greedy_verify", "mla_decode", "mla_prefill",
    "moe_experts_torch", "moe_experts_triton", "moe_route", "ngram_propose", "rms_norm", "rms_norm_pair", "sample",
    "write_kv_cache",
]
