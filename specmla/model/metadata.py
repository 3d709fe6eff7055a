"""What one forward step needs to know about its ragged batch; built once per step, read by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """The tokens of a step are packed request after request ([T] rows, no padding).

    - positions [T]: rope position of each new token.
    - slot_mapping [T] | None: cache slot (page * page_size + offset) of each new token;
      None runs without a cache (attention over the step's own tokens only).
    - cu_seqlens_q [B+1]: request i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1].
    - seq_lens [B]: tokens in the cache for request i, *including* this step's.
    - block_table [B, P] | None: pages of each request in order.
    - decode_query_len > 0: every request has exactly that many new tokens; attention takes the
      absorbed path (mla_decode over the paged latent cache). 0: prefill, MHA form.
    - context_slots [Σ seq_lens] | None: for prefill over a cached prefix (chunked prefill,
      prefix-cache hit), the cache slots of every context token, request after request;
      None when each request's context is exactly its new tokens.
    - kv_format: how cache rows are stored (ops.kv_cache): writes quantise, reads dequantise.
    - uniform_len > 0: cache-free batch of equal-length sequences (training); attention may then run
      as one batched causal SDPA instead of per-request.
    - prefill_schedule: the order of a ragged prefill's row blocks (`ops.prefill.prefill_schedule`), built by
      the first attention layer that needs it and shared by the others; None until then.
    """

    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int
    slot_mapping: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    decode_query_len: int = 0
    context_slots: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    kv_format: str = "auto"  # the cache's row format: auto (the model dtype) | fp8 | fp8_ds_mla | tbq4
    uniform_len: int = 0
    prefill_schedule: object | None = None

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def for_contiguous(cls, lengths: list[int], device=None) -> "AttentionMetadata":
        """Cache-free prefill of independent sequences (positions 0..len-1 each)."""
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        positions = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
        return cls(
            positions=positions.to(device),
            cu_seqlens_q=cu.to(device),
            seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            max_seqlen_q=max(lengths, default=0),
            max_seqlen_kv=max(lengths, default=0),
            cu_seqlens_kv=cu.to(device),
            uniform_len=lengths[0] if lengths and min(lengths) == max(lengths) else 0,
        )
