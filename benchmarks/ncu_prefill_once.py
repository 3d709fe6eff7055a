"""One causal prefill call for Nsight Compute: `ncu ... python3 benchmarks/ncu_prefill_once.py H S [triton]`
(d_qk 192 / d_v 128, bf16; the default call unless "triton" asks for the Triton kernel)."""

import sys

import torch

from specmla.ops.mla_prefill import mla_prefill_triton

H, S = int(sys.argv[1]), int(sys.argv[2])
gluon = False if len(sys.argv) > 3 and sys.argv[3] == "triton" else None
q = torch.randn(S, H, 192, device="cuda", dtype=torch.bfloat16)
k, v = torch.randn_like(q), torch.randn(S, H, 128, device="cuda", dtype=torch.bfloat16)
cu = torch.tensor([0, S], dtype=torch.int32, device="cuda")
for _ in range(2):
    mla_prefill_triton(q, k, v, cu, cu, S, S, 0.072, gluon=gluon)
torch.cuda.synchronize()
