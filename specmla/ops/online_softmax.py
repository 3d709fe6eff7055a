"""The online-softmax update and finish shared by the Triton attention kernels (decode, prefill).

Scores are in the log2 domain (already multiplied by softmax_scale·log2 e) and masked with −inf; a
row that has seen only masked keys keeps m = −inf, and its finished output is 0 with lse −inf.
"""

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One key block: returns (p, alpha, m_new, l_new). The caller rescales its accumulator by
    alpha and adds p @ V."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def online_softmax_finish(acc, m_i, l_i):
    """(normalised output, log2-sum-exp) of the accumulated rows."""
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    return out, lse2


@triton.jit
def split_merge_weights(lse2, AXIS: tl.constexpr):
    """Splits' partial log2-sum-exps along AXIS → (m_safe, 1 / total, the merged rows' log2-sum-exp): split i's
    partial output weighs exp2(lse2_i − m_safe) / total. Rows whose splits all saw no keys get weight 0 and
    lse2 −inf. Shared by the decode combines (`decode.triton.combine_splits`, `kv_cache.rotation.combine_rotate`)."""
    m = tl.max(lse2, AXIS)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return _merge_total(m_safe, tl.sum(tl.exp2(lse2 - tl.expand_dims(m_safe, AXIS)), AXIS))


@triton.jit
def _merge_total(m_safe, total):
    has = total > 0
    merged = tl.where(has, m_safe + tl.log2(tl.where(has, total, 1.0)), float("-inf"))
    return m_safe, 1.0 / tl.where(has, total, 1.0), merged
