"""Hopper MLA prefill (contract C2) in Gluon: FlashAttention-3's warp-specialised schedule (Shah et al. 2024)
for tiles of 128 query rows × 128 keys, P·V from registers.

- Three partitions (`gl.warp_specialize`): one producer warp issues TMA loads (per tile Q, each
  warpgroup's 64 rows once that warpgroup is done with its last tile's, then K_j and V_{j-1} into rings
  of NUM_STAGES stages, each with its own "landed" mbarrier); two consumer warpgroups each own 64 of the
  tile's 128 query rows and read the same stages.
- K and V stages are released separately (one arrival per warpgroup on the stage's "free"
  barrier): K as soon as both warpgroups' S_j has read it, V after their P·V, about a block later, so
  the producer loads K_{j+2} without waiting for P_j·V_j.
- A consumer issues S_j = Q·K_jᵀ, then P_{j-1}·V_{j-1}, both async, and waits for S_j first. ptxas
  treats the P registers that the P·V reads asynchronously as free after the issue and writes the next P
  (or a loop-carried value) into them, so it waits for the P·V before the exponentials: what overlaps
  the softmax is the other warpgroup's matmuls (`Options.pingpong` makes the two take turns).
- The softmax scale is folded into the exponent: p = 2^(s·c − m·c) with m the raw row max (one FMA
  per score). Only key blocks that cross the causal diagonal or the end of the keys are masked.
- A warpgroup's 64 output rows, when they all lie inside their request, are normalised into its own Q rows in
  shared memory and leave by one TMA store; its next Q rows load once the store has read them. Rows at a
  request's end (and every row when Q is not loaded per warpgroup or d_v differs from D1) are stored from
  registers under a mask.
- Ragged packs go through 2-D descriptors over [tokens, heads·dim]: a tile's rows past its request
  read the next request's rows (or zeros past the tensor); their keys are masked and their query
  rows are never stored.

Tiles (query rows × head × request) are numbered so that heads run in groups small enough for the
group's keys and values to stay in L2 while its tiles read them, the longest causal tiles of a group
first. The grid is persistent, one program per SM: the producer claims tiles from a counter in global
memory (the longest first, so the shortest fill the end) and hands their ids and bounds to the consumers
through shared memory, and the rings and barrier phases run on from tile to tile, so the next tile's Q and keys
load while the last one finishes. One request (B=1) numbers its tiles from its query blocks. A ragged
batch (B > 1) runs from a `PrefillSchedule`: its row blocks (request, query block), Σ_b ceil(q_len_b /
128) of them, sorted on the device by descending causal work, so no tile of a short request's empty
blocks launches and the longest blocks of every request start first; the kernel reads the row block
count from the schedule, and its head groups hold the keys and values of every request.
`Options(persistent=False)` runs one program per tile of (query block, head, request) instead. Each tile
visits its key blocks from the causal diagonal down, as FlashAttention-3 does: tiles that start together
then read different blocks of their head rather than all reading block 0, then 1, … at once.
Host side: after the first call of a specialisation the compiled kernel's launcher is called directly, and
the TMA descriptors are built without re-checking what `supported` checked.
Head dims: Dqk = D1 + DT (D1 a power of two ≥ 64, DT 0 or a power of two ≥ 16), Dv a power of two up
to 128 (256 spills); the tile ring must fit in shared memory. Gluon does not run in the Triton
interpreter: GPU tests check this kernel against the fp64 reference, and a CPU test compiles it
for sm_90.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from specmla.ops.decode.hopper import common as G
from specmla.ops.prefill.triton import head_dim_split
from specmla.ops.scratch import zeroed_scratch

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # renamed after Triton 3.6
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _cta_barrier = G._cta_barrier

BLOCK_M = 128  # query rows per program: two consumer warpgroups of 64 (wgmma's M)
BLOCK_N = 128  # keys per stage
NUM_STAGES = 2
SMEM_LIMIT = 227 * 1024  # H100's shared memory per block

_SOURCE_KEY = G.source_key(__file__)  # in the kernel's cache key (see G.source_key)
_c = getattr(gl, "constexpr", int) if G.HAVE_GLUON else int
# mbarriers: per consumer warpgroup, its Q rows landed; per stage: K landed, V landed, K free, V free (one
# arrival per consumer warpgroup); the turn of each warpgroup; per warpgroup, its Q rows free (its last S of a
# tile done, or its output rows staged there stored); per tile slot: id and bounds written, read (both warpgroups)
Q_READY = _c(0)  # +w
K_READY = _c(2)
V_READY = _c(2 + NUM_STAGES)
K_FREE = _c(2 + 2 * NUM_STAGES)
V_FREE = _c(2 + 3 * NUM_STAGES)
TURN = _c(2 + 4 * NUM_STAGES)  # +w: warpgroup w may issue its matmuls (pingpong)
Q_FREE = _c(4 + 4 * NUM_STAGES)  # +w
TILE_READY = _c(6 + 4 * NUM_STAGES)  # +slot
TILE_FREE = _c(8 + 4 * NUM_STAGES)  # +slot
NUM_BARRIERS = _c(10 + 4 * NUM_STAGES)
TILE_FIELDS = _c(8)  # a tile's id and bounds as the producer hands them to the consumers (`_publish`)
ROW_SHIFT = 16  # a schedule entry (`PrefillSchedule`): request << ROW_SHIFT | query block
_ROW_SHIFT = _c(ROW_SHIFT)


@dataclasses.dataclass(frozen=True)
class Options:
    """The Gluon prefill kernel's tuning knobs; the defaults are the measured best."""
    pingpong: bool = True  # the warpgroups take turns issuing their matmuls (FlashAttention-3's scheduler barrier)
    split_q: bool = True  # Q loaded per warpgroup, each half once that warpgroup's last S of a tile is done
    reverse: bool = True  # key blocks from the causal diagonal down (FlashAttention-3's order), else from 0 up
    # the persistent grid (None: on), ragged batches (B > 1) over their row blocks longest first (`PrefillSchedule`);
    # False: one program per (query block, head, request) of the longest request's query blocks
    persistent: bool | None = None
    heads_per_group: int | None = None  # heads that run side by side; None: `head_group`
    consumer_regs: int = 240  # FlashAttention-3's split of the register file: 2 × 128 threads × 240 + the producer
    producer_regs: int = 24
    fast_launch: bool = True  # call the compiled kernel's launcher directly once it exists (see `_launch`)


if G.HAVE_GLUON:

    @gluon.jit
    def _tile(t, CU_Q, CU_K, SCHED, H, N_M, head_group, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              CAUSAL: gl.constexpr, RAGGED: gl.constexpr):
        """Tile t's head, request, query rows and keys: [0, end) in n_blocks blocks (at least one, so a request
        with queries but no visible keys still runs the pipeline once, fully masked, and stores zeros).

        Tiles run in groups of `head_group` heads (as many as keep their keys in L2; the last group may be
        smaller). Numbered request by request (N_M query blocks each), within a group the longest causal tiles
        of every head come first, then the next longest, and so on. RAGGED: SCHED holds the batch's row block
        count and its row blocks longest first (`PrefillSchedule`); within a group the tiles run row block by
        row block in that order, each for every head of the group. A stop id decodes as some tile, never run."""
        if RAGGED:
            n_rb = gl.maximum(gl.load(SCHED), 1)
            t = gl.minimum(gl.maximum(t, 0), n_rb * H - 1)
            group_tiles = head_group * n_rb
            group = t // group_tiles
            r = t % group_tiles
            heads = gl.minimum(head_group, H - group * head_group)
            entry = gl.load(SCHED + 1 + r // heads)
            h = group * head_group + r % heads
            b = entry >> _ROW_SHIFT
            start_m = (entry & ((1 << _ROW_SHIFT) - 1)) * BLOCK_M
        else:
            per_request = N_M * H
            b = t // per_request
            group_tiles = head_group * N_M
            group = (t % per_request) // group_tiles
            r = (t % per_request) % group_tiles
            heads = gl.minimum(head_group, H - group * head_group)
            start_m = (N_M - 1 - r // heads) * BLOCK_M
            h = group * head_group + r % heads
        q0 = gl.load(CU_Q + b)
        q_len = gl.load(CU_Q + b + 1) - q0
        k0 = gl.load(CU_K + b)
        k_len = gl.load(CU_K + b + 1) - k0
        end = k_len
        if CAUSAL:
            end = gl.maximum(gl.minimum(k_len, k_len - q_len + start_m + BLOCK_M), 0)
        n_blocks = gl.maximum(gl.cdiv(end, BLOCK_N), 1)
        return h, b, q0, q_len, k0, k_len, start_m, end, n_blocks

    @gluon.jit
    def _tile_count(SCHED, H, N_TILES, RAGGED: gl.constexpr):
        """The tiles of this launch: N_TILES, or RAGGED the batch's row blocks (SCHED[0]) times H."""
        if RAGGED:
            n_tiles = gl.load(SCHED) * H
        else:
            n_tiles = N_TILES
        return n_tiles

    @gluon.jit
    def _running(t, N_TILES, RAGGED: gl.constexpr):
        """Consumer: whether tile id t is a tile rather than the producer's stop (RAGGED: -1, so the consumers
        keep no tile count in registers; else an id >= N_TILES)."""
        if RAGGED:
            live = t >= 0
        else:
            live = t < N_TILES
        return live

    @gluon.jit
    def _publish(tile_info, bars, k, t, h, q0, q_len, k_len, start_m, end):
        """Producer: tile number k's id t (or the stop id of `_running`) and bounds into slot k % 2, once both
        warpgroups have read what the slot held two tiles ago. The consumers read the bounds from shared memory
        rather than from the schedule and cu_seqlens in global memory: those dependent loads sit on the
        consumers' path between two tiles, while the producer runs a tile ahead."""
        FIELDS: gl.constexpr = gl.BlockedLayout([TILE_FIELDS], [32], [1], [0])
        i = gl.arange(0, TILE_FIELDS, layout=FIELDS)
        info = gl.where(i == 0, t, gl.where(i == 1, h, gl.where(i == 2, q0, gl.where(i == 3, q_len, gl.where(
            i == 4, k_len, gl.where(i == 5, start_m, end))))))
        slot = k % 2
        mbarrier.wait(bars.index(TILE_FREE + slot), ((k // 2) + 1) & 1, pred=k >= 2)
        tile_info.index(slot).store(info)
        _cta_barrier()
        mbarrier.arrive(bars.index(TILE_READY + slot))

    @gluon.jit
    def _field(info, i: gl.constexpr):
        """Field i of a tile's bounds, every thread holding all of them (no shuffle, no barrier)."""
        idx = gl.arange(0, TILE_FIELDS, layout=info.type.layout)
        return gl.sum(gl.where(idx == i, info, 0), axis=0)

    @gluon.jit
    def _next_tile(tile_info, bars, k, BLOCK_N: gl.constexpr):
        """Consumer warpgroup: tile number k's id and bounds (`_publish`): t, h, q0, q_len, k_len, start_m, end and
        n_blocks (the key blocks of [0, end), at least one)."""
        FIELDS: gl.constexpr = gl.BlockedLayout([TILE_FIELDS], [32], [4], [0])
        slot = k % 2
        mbarrier.wait(bars.index(TILE_READY + slot), (k // 2) & 1)
        info = tile_info.index(slot).load(FIELDS)
        _release(bars, TILE_FREE + slot)
        end = _field(info, 6)
        n_blocks = gl.maximum(gl.cdiv(end, BLOCK_N), 1)
        return (_field(info, 0), _field(info, 1), _field(info, 2), _field(info, 3), _field(info, 4), _field(info, 5),
                end, n_blocks)

    @gluon.jit
    def _claim(COUNTER, N_TILES, DYNAMIC: gl.constexpr):
        """This program's next tile: DYNAMIC (persistent grid) the next unclaimed one (programs first take
        tiles 0 … grid-1, then count on from the grid size); else none."""
        if DYNAMIC:
            t = gl.num_programs(0) + gl.atomic_add(COUNTER, 1)
        else:
            t = N_TILES
        return t

    @gluon.jit
    def _producer(shared, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  D1: gl.constexpr, DT: gl.constexpr, DV: gl.constexpr, CAUSAL: gl.constexpr,
                  DYNAMIC: gl.constexpr, RAGGED: gl.constexpr, SPLIT_Q: gl.constexpr, REVERSE: gl.constexpr):
        """One warp: claims the tiles and tells the consumers; per tile TMA Q (once the last tile's S
        matmuls are done with it), then K_j / V_j into stage (blocks so far) % NUM_STAGES once both
        warpgroups freed it."""
        (q_desc, qt_desc, k_desc, kt_desc, v_desc, o_desc, O, LSE, CU_Q, CU_K, SCHED, H, N_M, N_TILES, head_group,
         COUNTER, stride_ot, stride_oh, stride_lt, scale_log2,
         q_smem, qt_smem, k_smem, kt_smem, v_smem, bars, tile_info) = shared
        DQK: gl.constexpr = D1 + DT
        ELEM: gl.constexpr = q_desc.dtype.primitive_bitwidth // 8
        k_bytes: gl.constexpr = BLOCK_N * DQK * ELEM
        v_bytes: gl.constexpr = BLOCK_N * DV * ELEM
        n_tiles = _tile_count(SCHED, H, N_TILES, RAGGED)
        t = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
        k = 0  # tiles published (id and bounds)
        tiles = 0  # tiles run (each loads Q once)
        c0 = 0  # key blocks of the tiles before this one (the rings' stage and phase count on across tiles)
        while t < n_tiles:
            h, b, q0, q_len, k0, k_len, start_m, end, n_blocks = _tile(t, CU_Q, CU_K, SCHED, H, N_M, head_group,
                                                                       BLOCK_M, BLOCK_N, CAUSAL, RAGGED)
            _publish(tile_info, bars, k, t, h, q0, q_len, k_len, start_m, end)
            k += 1
            if start_m < q_len:
                if SPLIT_Q:  # each warpgroup's rows as soon as that warpgroup is done with its last ones
                    WG_M: gl.constexpr = BLOCK_M // 2
                    for w in gl.static_range(2):
                        mbarrier.wait(bars.index(Q_FREE + w), (tiles + 1) & 1, pred=tiles > 0)
                        mbarrier.expect(bars.index(Q_READY + w), WG_M * DQK * ELEM)
                        row = q0 + start_m + w * WG_M
                        _tma_load(q_desc, [row, h * DQK], bars.index(Q_READY + w), q_smem.slice(w * WG_M, WG_M))
                        if DT > 0:
                            _tma_load(qt_desc, [row, h * DQK + D1], bars.index(Q_READY + w),
                                      qt_smem.slice(w * WG_M, WG_M))
                else:
                    mbarrier.wait(bars.index(Q_FREE), (tiles + 1) & 1, pred=tiles > 0)
                    mbarrier.expect(bars.index(Q_READY), BLOCK_M * DQK * ELEM)
                    _tma_load(q_desc, [q0 + start_m, h * DQK], bars.index(Q_READY), q_smem)
                    if DT > 0:
                        _tma_load(qt_desc, [q0 + start_m, h * DQK + D1], bars.index(Q_READY), qt_smem)
                # K_j, then V_{j-1}: a K stage frees once both warpgroups' S has read it, a V stage only after
                # their P·V, about a block later, so K runs ahead of V
                for j in range(n_blocks + 1):
                    if j < n_blocks:
                        c = c0 + j
                        st = c % NUM_STAGES
                        mbarrier.wait(bars.index(K_FREE + st), ((c // NUM_STAGES) + 1) & 1, pred=c >= NUM_STAGES)
                        row = k0 + _block_at(j, n_blocks, REVERSE) * BLOCK_N
                        mbarrier.expect(bars.index(K_READY + st), k_bytes)
                        _tma_load(k_desc, [row, h * DQK], bars.index(K_READY + st), k_smem.index(st))
                        if DT > 0:
                            _tma_load(kt_desc, [row, h * DQK + D1], bars.index(K_READY + st), kt_smem.index(st))
                    if j > 0:
                        cv = c0 + j - 1
                        sv = cv % NUM_STAGES
                        mbarrier.wait(bars.index(V_FREE + sv), ((cv // NUM_STAGES) + 1) & 1, pred=cv >= NUM_STAGES)
                        mbarrier.expect(bars.index(V_READY + sv), v_bytes)
                        row = k0 + _block_at(j - 1, n_blocks, REVERSE) * BLOCK_N
                        _tma_load(v_desc, [row, h * DV], bars.index(V_READY + sv), v_smem.index(sv))
                tiles += 1
                c0 += n_blocks
            # claimed once this tile's loads are issued, about NUM_STAGES blocks before its consumers finish: the
            # atomic's latency hides there, and a tile claimed at this tile's start would wait behind a whole
            # tile while other programs run dry at the end
            t = _claim(COUNTER, n_tiles, DYNAMIC)
        if RAGGED:
            t = -1
        _publish(tile_info, bars, k, t, 0, 0, 0, 0, 0, 0)  # the stop id (`_running`): the consumers stop
        if DYNAMIC:  # the last program to finish leaves the counter at zero for the next launch
            if gl.atomic_add(COUNTER + 1, 1) == gl.num_programs(0) - 1:
                gl.atomic_xchg(COUNTER, 0)
                gl.atomic_xchg(COUNTER + 1, 0)

    @gluon.jit
    def _block_at(j, n_blocks, REVERSE: gl.constexpr):
        """The key block a tile visits j-th: REVERSE from its last block (the causal diagonal) down, as
        FlashAttention-3 does; else from block 0 up."""
        if REVERSE:
            return n_blocks - 1 - j
        else:
            return j

    @gluon.jit
    def _scores(q, qt, k_smem, kt_smem, st, s_zero, DT: gl.constexpr):
        """Issue S = Q·K_stᵀ (the D1 part, then the DT tail) without waiting."""
        s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if DT > 0:
            s = warpgroup_mma(qt, kt_smem.index(st).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _release(bars, index, pred=True):
        """This warpgroup is done with a stage buffer (its matmuls that read it have completed)."""
        _cta_barrier()
        mbarrier.arrive(bars.index(index), pred=pred)

    @gluon.jit
    def _release_k(bars, st, last, q_free):
        """S of a block is done: its K stage is free, and after the tile's last block this warpgroup's Q
        rows are too (barrier q_free)."""
        _cta_barrier()
        mbarrier.arrive(bars.index(K_FREE + st))
        mbarrier.arrive(bars.index(q_free), pred=last)

    @gluon.jit
    def _release_v_tail(bars, c_last, two, NUM_STAGES: gl.constexpr):
        """After a tile's last P·V: the V stages of its last two blocks (or its only one) are free; the steps
        released every earlier block's."""
        _cta_barrier()
        mbarrier.arrive(bars.index(V_FREE + (c_last - 1) % NUM_STAGES), pred=two)
        mbarrier.arrive(bars.index(V_FREE + c_last % NUM_STAGES))

    @gluon.jit
    def _take_turn(bars, i, ROLE: gl.constexpr, PINGPONG: gl.constexpr):
        """PINGPONG: wait until the other warpgroup has issued its matmuls of the previous round (warpgroup 0
        goes first); round i is this warpgroup's i-th batch of matmuls (counted across tiles)."""
        if PINGPONG:
            if ROLE == 0:
                mbarrier.wait(bars.index(TURN), (i + 1) & 1, pred=i > 0)
            else:
                mbarrier.wait(bars.index(TURN + 1), i & 1)

    @gluon.jit
    def _pass_turn(bars, ROLE: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(bars.index(TURN + 1 - ROLE))

    @gluon.jit
    def _softmax(s, m_i, l_i, n0, end, limit, scale_log2, masked, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                 S_LAYOUT: gl.constexpr):
        """Online softmax of one block of raw scores: P (at the new max), the old rows' rescale factor,
        the new raw max and row sums. Masked blocks first hide keys at or past `end` and, when CAUSAL,
        right of each row's limit."""
        if masked:
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
            visible = gl.expand_dims(cols < end, 0)
            if CAUSAL:
                visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(limit, 1))
            s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_c = gl.where(m_new == float("-inf"), 0.0, m_new) * scale_log2
        alpha = gl.exp2(m_i * scale_log2 - m_c)
        p = gl.exp2(s * scale_log2 - gl.expand_dims(m_c, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _step(j, n0, c0, r0, q_free_at, p, m_i, l_i, acc, q, qt, k_smem, kt_smem, v_smem, bars, s_zero, end, limit,
              scale_log2, MASKED: gl.constexpr, ROLE: gl.constexpr, QI: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr,
              DT: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, P_OPERAND: gl.constexpr,
              S_LAYOUT: gl.constexpr, ROW_O: gl.constexpr):
        """The tile's j-th key block (keys from n0; block c0 + j of this program, matmul round r0 + j): issue S_j and
        P_{j-1}·V_{j-1}, then the softmax of block j, O rescaled to block j's max and P_j in 16 bits. K_j
        (and Q when j is q_free_at) is released once S_j is done; V_{j-2} here, after the issue (its
        P·V completed in the previous step; a release right after that wait would pull the wait earlier)."""
        c = c0 + j
        st = c % NUM_STAGES
        prev = (c - 1) % NUM_STAGES
        mbarrier.wait(bars.index(K_READY + st), (c // NUM_STAGES) & 1)
        mbarrier.wait(bars.index(V_READY + prev), ((c - 1) // NUM_STAGES) & 1)
        p_op = gl.convert_layout(p, P_OPERAND)
        _take_turn(bars, r0 + j, ROLE, PINGPONG)
        s = _scores(q, qt, k_smem, kt_smem, st, s_zero, DT)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        _pass_turn(bars, ROLE, PINGPONG)
        _release(bars, V_FREE + (c - 2) % NUM_STAGES, j >= 2)  # block j-2's P·V completed in the last step
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        _release_k(bars, st, j == q_free_at, Q_FREE + QI)
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, n0, end, limit, scale_log2, MASKED, BLOCK_N, CAUSAL, S_LAYOUT)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
        # P in 16 bits only now: its registers are the operand of the P·V that was in flight
        return p.to(q.dtype), m_i, l_i, acc

    @gluon.jit
    def _attend(ROLE: gl.constexpr, shared, tiles, c0, r0, q_len, k_len, start_m, end, n_blocks, keep_q,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, DT: gl.constexpr,
                DV: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, SPLIT_Q: gl.constexpr,
                REVERSE: gl.constexpr, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr):
        """This warpgroup's rows of one tile over every key block: the unnormalised output, row max and
        row sums (the program's `tiles`-th tile; its blocks start at c0 and its matmul rounds at r0). Its Q rows are
        released after the tile's last S, or with keep_q by the caller (`_store_o_tma` stages the output there)."""
        (q_desc, qt_desc, k_desc, kt_desc, v_desc, o_desc, O, LSE, CU_Q, CU_K, SCHED, H, N_M, N_TILES, head_group,
         COUNTER, stride_ot, stride_oh, stride_lt, scale_log2,
         q_smem, qt_smem, k_smem, kt_smem, v_smem, bars, tile_info) = shared
        dtype: gl.constexpr = q_smem.dtype
        WG_M: gl.constexpr = BLOCK_M // 2
        P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        row0 = start_m + ROLE * WG_M
        rows = row0 + gl.arange(0, WG_M, layout=ROW_S)
        limit = k_len - q_len + rows  # row t sees keys j <= limit (causal)
        full_end = end  # keys before full_end are visible to every row of this warpgroup
        if CAUSAL:
            full_end = gl.minimum(gl.maximum(k_len - q_len + row0 + 1, 0), end)
        full_end = full_end // BLOCK_N * BLOCK_N
        q = q_smem.slice(ROLE * WG_M, WG_M, dim=0)
        qt = qt_smem.slice(ROLE * WG_M, WG_M, dim=0)
        s_zero = gl.zeros([WG_M, BLOCK_N], gl.float32, layout=S_LAYOUT)
        m_i = gl.full([WG_M], float("-inf"), gl.float32, layout=ROW_S)
        l_i = gl.full([WG_M], 0.0, gl.float32, layout=ROW_S)
        acc = gl.zeros([WG_M, DV], gl.float32, layout=O_LAYOUT)
        last = n_blocks - 1
        q_free_at = last  # the block whose S releases this warpgroup's Q rows; -1: none
        if keep_q:
            q_free_at = -1
        QI: gl.constexpr = ROLE if SPLIT_Q else 0  # this warpgroup's Q barriers

        mbarrier.wait(bars.index(Q_READY + QI), tiles & 1)
        mbarrier.wait(bars.index(K_READY + c0 % NUM_STAGES), (c0 // NUM_STAGES) & 1)
        _take_turn(bars, r0, ROLE, PINGPONG)
        s = _scores(q, qt, k_smem, kt_smem, c0 % NUM_STAGES, s_zero, DT)
        _pass_turn(bars, ROLE, PINGPONG)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        _release_k(bars, c0 % NUM_STAGES, q_free_at == 0, Q_FREE + QI)
        n_full = full_end // BLOCK_N  # blocks 0 … n_full-1 are visible to every row: no masks
        n_masked = n_blocks - n_full
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, _block_at(0, n_blocks, REVERSE) * BLOCK_N, end, limit, scale_log2,
                                      (n_masked > 0) if REVERSE else (n_full == 0), BLOCK_N, CAUSAL, S_LAYOUT)
        p = p.to(dtype)
        # REVERSE: the masked blocks from the diagonal down, then the rest without masks; else the blocks left
        # of the diagonal without masks, then the rest with them
        split = n_masked if REVERSE else n_full
        for j in range(1, split):
            p, m_i, l_i, acc = _step(j, _block_at(j, n_blocks, REVERSE) * BLOCK_N, c0, r0, q_free_at, p, m_i, l_i,
                                     acc, q, qt, k_smem, kt_smem, v_smem, bars, s_zero, end, limit, scale_log2,
                                     REVERSE, ROLE, QI, BLOCK_N, NUM_STAGES, DT, CAUSAL, PINGPONG, P_OPERAND,
                                     S_LAYOUT, ROW_O)
        for j in range(gl.maximum(split, 1), n_blocks):
            p, m_i, l_i, acc = _step(j, _block_at(j, n_blocks, REVERSE) * BLOCK_N, c0, r0, q_free_at, p, m_i, l_i,
                                     acc, q, qt, k_smem, kt_smem, v_smem, bars, s_zero, end, limit, scale_log2,
                                     not REVERSE, ROLE, QI, BLOCK_N, NUM_STAGES, DT, CAUSAL, PINGPONG, P_OPERAND,
                                     S_LAYOUT, ROW_O)
        c_last = c0 + last
        mbarrier.wait(bars.index(V_READY + c_last % NUM_STAGES), (c_last // NUM_STAGES) & 1)
        p_op = gl.convert_layout(p, P_OPERAND)
        _take_turn(bars, r0 + n_blocks, ROLE, PINGPONG)
        acc = warpgroup_mma(p_op, v_smem.index(c_last % NUM_STAGES), acc, is_async=True)
        _pass_turn(bars, ROLE, PINGPONG)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _release_v_tail(bars, c_last, last >= 1, NUM_STAGES)
        return acc, m_i, l_i

    @gluon.jit
    def _store_lse(m_i, l_i, LSE, q0, q_len, row0, h, stride_lt, scale_log2, WG_M: gl.constexpr,
                   S_LAYOUT: gl.constexpr):
        """One warpgroup's rows' natural-log lse (-inf for rows that saw no key)."""
        has = l_i > 0
        lse2 = gl.where(has, m_i * scale_log2 + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
        rows = row0 + gl.arange(0, WG_M, layout=gl.SliceLayout(1, S_LAYOUT))
        gl.store(LSE + (q0 + rows).to(gl.int64) * stride_lt + h, lse2 * 0.6931471805599453, mask=rows < q_len)

    @gluon.jit
    def _normalised(acc, l_i, O_LAYOUT: gl.constexpr):
        inv_l = gl.convert_layout(1.0 / gl.where(l_i > 0, l_i, 1.0), gl.SliceLayout(1, O_LAYOUT))
        return acc * gl.expand_dims(inv_l, 1)

    @gluon.jit
    def _store_o(acc, l_i, O, q0, q_len, row0, h, stride_ot, stride_oh, WG_M: gl.constexpr, DV: gl.constexpr,
                 O_LAYOUT: gl.constexpr):
        """Normalise and store one warpgroup's output rows from registers, the rows past q_len masked."""
        out = _normalised(acc, l_i, O_LAYOUT)
        rows_o = row0 + gl.arange(0, WG_M, layout=gl.SliceLayout(1, O_LAYOUT))
        cols_o = gl.arange(0, DV, layout=gl.SliceLayout(0, O_LAYOUT))
        o_ptrs = O + gl.expand_dims((q0 + rows_o).to(gl.int64) * stride_ot + h * stride_oh, 1) + \
            gl.expand_dims(cols_o, 0)
        o_ok = gl.expand_dims(rows_o < q_len, 1) & gl.expand_dims(cols_o < DV, 0)
        gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_ok)

    @gluon.jit
    def _store_o_tma(acc, l_i, o_desc, q_smem, bars, q0, row0, h, ROLE: gl.constexpr, WG_M: gl.constexpr,
                     DV: gl.constexpr, O_LAYOUT: gl.constexpr):
        """Normalise one warpgroup's 64 output rows (all inside the request) into its own Q rows in shared memory
        (the tile's S matmuls are done with them), store them with one TMA copy and release the Q rows once the
        copy has read them: stores from the matmul's register layout write 4 bytes per thread across 8 rows and
        hold the warpgroup up for longer."""
        stage = q_smem.slice(ROLE * WG_M, WG_M, dim=0)
        stage.store(_normalised(acc, l_i, O_LAYOUT).to(o_desc.dtype))
        fence_async_shared()
        _cta_barrier()
        _tma_store(o_desc, [q0 + row0, h * DV], stage)
        tma.store_wait(0)
        _release(bars, Q_FREE + ROLE)

    @gluon.jit
    def _consumer(ROLE: gl.constexpr, shared, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  NUM_STAGES: gl.constexpr, D1: gl.constexpr, DT: gl.constexpr, DV: gl.constexpr,
                  CAUSAL: gl.constexpr, RAGGED: gl.constexpr, PINGPONG: gl.constexpr, SPLIT_Q: gl.constexpr,
                  REVERSE: gl.constexpr, TMA_OUT: gl.constexpr):
        """Warpgroup ROLE: query rows ROLE·64 … +64 of each tile the producer hands over. TMA_OUT: rows that lie
        inside their request leave through `_store_o_tma` before the next tile's bounds are read (its Q load
        waits for that store); the others, and every row without TMA_OUT, through registers after it."""
        (q_desc, qt_desc, k_desc, kt_desc, v_desc, o_desc, O, LSE, CU_Q, CU_K, SCHED, H, N_M, N_TILES, head_group,
         COUNTER, stride_ot, stride_oh, stride_lt, scale_log2,
         q_smem, qt_smem, k_smem, kt_smem, v_smem, bars, tile_info) = shared
        WG_M: gl.constexpr = BLOCK_M // 2
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, DV, 16])
        k = 0  # tiles read
        tiles = 0  # tiles run
        c0 = 0  # key blocks so far (K/V ring position); matmul rounds so far (turn parity): c0 + tiles
        t, h, q0, q_len, k_len, start_m, end, n_blocks = _next_tile(tile_info, bars, k, BLOCK_N)
        k += 1
        while _running(t, N_TILES, RAGGED):
            n_done = n_blocks
            if start_m < q_len:
                row0 = start_m + ROLE * WG_M
                staged = row0 < 0  # a runtime False: both branches give `staged` one type
                if TMA_OUT:
                    staged = row0 + WG_M <= q_len
                acc, m_i, l_i = _attend(ROLE, shared, tiles, c0, c0 + tiles, q_len, k_len, start_m, end, n_blocks,
                                        staged, BLOCK_M, BLOCK_N, NUM_STAGES, DT, DV, CAUSAL, PINGPONG, SPLIT_Q,
                                        REVERSE, S_LAYOUT, O_LAYOUT)
                if TMA_OUT:
                    if staged:
                        _store_o_tma(acc, l_i, o_desc, q_smem, bars, q0, row0, h, ROLE, WG_M, DV, O_LAYOUT)
                h_done, q0_done, q_len_done = h, q0, q_len
                t, h, q0, q_len, k_len, start_m, end, n_blocks = _next_tile(tile_info, bars, k, BLOCK_N)
                if not staged:
                    _store_o(acc, l_i, O, q0_done, q_len_done, row0, h_done, stride_ot, stride_oh, WG_M, DV,
                             O_LAYOUT)
                _store_lse(m_i, l_i, LSE, q0_done, q_len_done, row0, h_done, stride_lt, scale_log2, WG_M, S_LAYOUT)
                tiles += 1
                c0 += n_done
            else:
                t, h, q0, q_len, k_len, start_m, end, n_blocks = _next_tile(tile_info, bars, k, BLOCK_N)
            k += 1

    # the tile counts and head group change with every step's lengths: not specialised, so a new length compiles
    # nothing
    @gluon.jit(do_not_specialize=["N_M", "N_TILES", "head_group"])
    def _mla_prefill_ws_kernel(
        q_desc, qt_desc, k_desc, kt_desc, v_desc, o_desc, O, LSE, CU_Q, CU_K, SCHED, H, N_M, N_TILES, head_group,
        COUNTER, stride_ot, stride_oh, stride_lt, scale_log2,
        D1: gl.constexpr, DT: gl.constexpr, TAIL: gl.constexpr, DV: gl.constexpr, TMA_OUT: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
        PINGPONG: gl.constexpr, DYNAMIC: gl.constexpr, RAGGED: gl.constexpr, SPLIT_Q: gl.constexpr,
        REVERSE: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, SOURCE_KEY: gl.constexpr, num_warps: gl.constexpr,
    ):
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D1], q_desc.layout)
        qt_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, TAIL], qt_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D1], k_desc.layout)
        kt_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, TAIL], kt_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, DV], v_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_BARRIERS, 1], mbarrier.MBarrierLayout())
        tile_info = gl.allocate_shared_memory(gl.int32, [2, TILE_FIELDS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        for i in gl.static_range(NUM_BARRIERS):
            # barriers that both consumer warpgroups arrive on count two
            mbarrier.init(bars.index(i), count=2 if (i >= K_FREE and i < TURN) or (i == Q_FREE and not SPLIT_Q)
                          or i >= TILE_FREE else 1)
        fence_async_shared()

        shared = (q_desc, qt_desc, k_desc, kt_desc, v_desc, o_desc, O, LSE, CU_Q, CU_K, SCHED, H, N_M, N_TILES,
                  head_group, COUNTER, stride_ot, stride_oh, stride_lt, scale_log2,
                  q_smem, qt_smem, k_smem, kt_smem, v_smem, bars, tile_info)
        gl.warp_specialize([
            (_consumer, (0, shared, BLOCK_M, BLOCK_N, NUM_STAGES, D1, DT, DV, CAUSAL, RAGGED, PINGPONG, SPLIT_Q,
                         REVERSE, TMA_OUT)),
            (_consumer, (1, shared, BLOCK_M, BLOCK_N, NUM_STAGES, D1, DT, DV, CAUSAL, RAGGED, PINGPONG, SPLIT_Q,
                         REVERSE, TMA_OUT)),
            (_producer, (shared, BLOCK_M, BLOCK_N, NUM_STAGES, D1, DT, DV, CAUSAL, DYNAMIC, RAGGED, SPLIT_Q,
                         REVERSE)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


L2_SHARE = 0.25  # of the L2 cache that one group of heads' keys and values may fill (2 heads at 8k, H100)


def _device_facts(device: torch.device) -> tuple[int, int, int]:
    """(compute capability major, L2 bytes, SMs) of a CUDA device: asked once, not on every call."""
    return _device_facts_at(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_facts_at(index: int) -> tuple[int, int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major, props.L2_cache_size, props.multi_processor_count


def _tile_counter(device: torch.device) -> torch.Tensor:
    """Two int32 words (next tile, programs done) for the persistent grid's tile claims. The kernel leaves
    them at zero when it ends; launches that may overlap (other streams) each get their own."""
    return zeroed_scratch("prefill_tiles", 2, device)


def head_group(H: int, kv_len: int, dim: int, elem: int, device) -> int:
    """How many heads run side by side: few enough that their keys and values (kv_len × (d_qk + d_v)) fill
    L2_SHARE of L2, in groups of equal size: the largest divisor of H that fits, unless that is under half
    of what fits, then as equal as ceilings allow (a smaller last group runs its longest tiles alone at the
    end)."""
    l2 = _device_facts(device)[1] if device.type == "cuda" else 50 << 20
    return _head_group(H, kv_len * dim * elem, l2)


@functools.lru_cache(maxsize=None)
def _head_group(H: int, head_bytes: int, l2: int) -> int:
    fits = max(1, min(H, int(L2_SHARE * l2) // max(1, head_bytes)))
    divisor = max(d for d in range(1, fits + 1) if H % d == 0)
    if 2 * divisor >= fits:
        return divisor
    groups = -(-H // fits)
    return -(-H // groups)


MAX_REQUESTS = 1 << (31 - ROW_SHIFT)
MAX_Q_TOKENS = BLOCK_M << ROW_SHIFT


@dataclasses.dataclass(frozen=True)
class PrefillSchedule:
    """The row blocks (request b, query block m of BLOCK_M rows) of a ragged batch in the order the persistent
    kernel runs them, built on the device without a host sync (`prefill_schedule`).

    table: int32 [1 + rb_max] on the batch's device. table[0] is the number n of row blocks (Σ_b ceil(q_len_b /
    BLOCK_M)); table[1 + i] for i < n is the i-th row block as b << ROW_SHIFT | m, in descending causal work
    (`end`, the keys it attends to), ties in batch order. Entries past n are never run; table[1] holds a real
    request's block even when n = 0 (the kernel decodes its stop id there). rb_max = max(1, (T + (BLOCK_M − 1)·B)
    // BLOCK_M) bounds n. num_q_tokens (T), num_requests (B): the batch it was built for, checked against each
    call."""
    table: torch.Tensor
    num_q_tokens: int
    num_requests: int

    @property
    def max_row_blocks(self) -> int:
        return self.table.shape[0] - 1


def prefill_schedule(cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, num_q_tokens: int, *,
                     causal: bool = True) -> PrefillSchedule:
    """The longest-processing-time-first order of a ragged batch's row blocks (`PrefillSchedule`), in torch ops
    on cu_seqlens' device with no host sync: a row block's work is its key count end = min(k_len, k_len − q_len
    + (m + 1)·BLOCK_M) when causal (bottom-right aligned, as the kernel's `_tile`), else k_len. One schedule
    serves every call on the same batch (every layer of a forward)."""
    B = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_kv.shape[0] != B + 1:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_kv "
                         f"{tuple(cu_seqlens_kv.shape)} describe different batches")
    if not 0 <= B < MAX_REQUESTS or not 0 <= num_q_tokens < MAX_Q_TOKENS:
        raise ValueError(f"a prefill schedule takes fewer than {MAX_REQUESTS} requests and {MAX_Q_TOKENS} query "
                         f"tokens (got {B}, {num_q_tokens})")
    device = cu_seqlens_q.device
    rb_max = max(1, (num_q_tokens + (BLOCK_M - 1) * B) // BLOCK_M)  # Σ ceil(q_len / BLOCK_M) ≤ this
    if B == 0:
        return PrefillSchedule(torch.zeros(1 + rb_max, dtype=torch.int32, device=device), num_q_tokens, B)
    i32 = torch.int32
    cu = torch.stack((cu_seqlens_q, cu_seqlens_kv)).to(i32)
    lens = cu.diff(dim=1)  # [2, B]: q_len, k_len
    blocks = lens[0].add(BLOCK_M - 1) // BLOCK_M
    last = blocks.cumsum(0, dtype=i32)  # one past each request's last row block
    i = torch.arange(rb_max, dtype=i32, device=device)
    b = torch.searchsorted(last[:-1], i, right=True, out_int32=True)  # the request of row block i (the last past n)
    # per request: its first row block, k_len − q_len (the causal offset), k_len; gathered per row block
    first, offset, k_len = torch.stack((last - blocks, lens[1] - lens[0], lens[1])).index_select(1, b)
    m = i - first
    work = torch.minimum(k_len, torch.add(offset, m + 1, alpha=BLOCK_M)).clamp_(min=0) if causal else k_len
    work = work.masked_fill_(i >= last[-1], -1)  # past the last row block: after every real one
    order = torch.argsort(work, descending=True, stable=True)
    entries = torch.add(m, b, alpha=1 << ROW_SHIFT)[order]
    return PrefillSchedule(torch.cat((last[-1:], entries)), num_q_tokens, B)


def _smem_bytes(d1: int, dt: int, dv: int, elem: int) -> int:
    return (BLOCK_M * (d1 + dt) + NUM_STAGES * BLOCK_N * (d1 + dt + dv)) * elem + 1024


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
              opts: Options = Options()) -> bool:
    """Whether the Gluon kernel takes this call: Hopper, bf16/fp16, each tensor's heads packed in its
    rows (stride(1) = head dim, TMA-aligned rows), power-of-two dims that fit the tile ring."""
    if not (G.HAVE_GLUON and q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1" and k.shape[0] > 0):
        return False
    if _device_facts(q.device)[0] != 9 or softmax_scale <= 0:
        return False
    dqk, dv = q.shape[-1], v.shape[-1]
    d1, dt = head_dim_split(dqk)
    pow2 = lambda x: x & (x - 1) == 0  # noqa: E731
    if not (q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype):
        return False
    if not (d1 >= 64 and (dt == 0 or (dt >= 16 and pow2(dt))) and dv >= 64 and pow2(dv) and dv <= 128):
        return False
    for t in (q, k, v):
        stride = t.stride()  # once: this check runs on every call (host time)
        if stride[-1] != 1 or stride[1] != t.shape[-1] or (stride[0] * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return _smem_bytes(d1, dt, dv, q.element_size()) <= SMEM_LIMIT


def _descriptor(t: torch.Tensor, rows: int, width: int):
    """2-D TMA view [tokens, heads·dim] of t with [rows, width] boxes (the kernel picks the columns). Built
    without TensorDescriptor's own checks (host time, five per call): `supported` has checked the same
    (16-byte aligned base and row stride, contiguous last dimension)."""
    T, H, D = t.shape
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(_descriptor_defaults())  # fields with defaults differ between Triton versions
    desc.base, desc.shape, desc.strides = t, [T, H * D], [t.stride(0), 1]
    desc.block_shape, desc.layout = [rows, width], G._smem_layout((rows, width), t.dtype)
    return desc


@functools.lru_cache(maxsize=None)
def _descriptor_defaults() -> dict:
    return {f.name: f.default for f in dataclasses.fields(TensorDescriptor) if f.default is not dataclasses.MISSING}


_COMPILED: dict = {}  # launch key (see _launch) → the compiled kernel


def _int_key(x: int) -> tuple:
    """What Triton specialises an integer argument on: the value 1, divisibility by 16, a 64-bit value."""
    return x == 1, x % 16 == 0, not -2 ** 31 <= x < 2 ** 31


def _launch(grid, named: dict, key: tuple, fast: bool):
    """Run the kernel with the arguments `named`. Triton's launch path (binding, specialising every argument,
    the cache lookup) costs more host time than the rest of the call: with `fast`, once this specialisation
    (`key`: the constexprs, the integers' and pointers' properties that Triton specialises on) has compiled,
    its launcher is called directly."""
    compiled = _COMPILED.get(key) if fast else None
    if compiled is None:
        compiled = _mla_prefill_ws_kernel[grid](**named)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        if fast and hasattr(compiled, "packed_metadata"):
            _COMPILED[key] = compiled
        return
    compiled[(grid[0], grid[1], 1)](*[named[name] for name in _mla_prefill_ws_kernel.arg_names])


def _tma_out(o: torch.Tensor, q: torch.Tensor, d1: int, opts: Options) -> bool:
    """Whether the output rows leave by TMA through each warpgroup's Q rows in shared memory (`_store_o_tma`): Q
    loaded per warpgroup, an output row as wide as Q's first part (the same shared layout), heads packed in
    TMA-aligned rows of q's dtype."""
    stride = o.stride()
    return (opts.split_q and o.shape[-1] == d1 and o.dtype == q.dtype and stride[-1] == 1 and stride[1] == d1
            and (stride[0] * o.element_size()) % 16 == 0 and o.data_ptr() % 16 == 0)


def _check_schedule(schedule: PrefillSchedule, T: int, B: int, device: torch.device) -> None:
    if (schedule.num_q_tokens, schedule.num_requests) != (T, B) or schedule.table.device != device:
        raise ValueError(f"the prefill schedule was built for {schedule.num_requests} requests and "
                         f"{schedule.num_q_tokens} query tokens on {schedule.table.device}, this call has {B} and {T} "
                         f"on {device}")


def mla_prefill_hopper(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, softmax_scale, *,
                       causal: bool = True, return_lse: bool = False, out: torch.Tensor | None = None,
                       schedule: PrefillSchedule | None = None, opts: Options = Options()):
    """Same contract as `mla_prefill_torch`; callers check `supported` first. A ragged batch (B > 1) on the
    persistent grid runs its row blocks in `schedule`'s order, built here when None (`prefill_schedule`)."""
    T, H, dqk = q.shape
    dv = v.shape[-1]
    B = cu_seqlens_q.shape[0] - 1
    d1, dt = head_dim_split(dqk)
    o = out if out is not None else q.new_empty(T, H, dv)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T and B and max_seqlen_q:
        tail = max(dt, 16)  # a stand-in box when there is no tail (never loaded)
        persistent = opts.persistent is not False
        ragged = persistent and B > 1
        sms = _device_facts(q.device)[2] if q.is_cuda else 132  # (CPU tensors: an offline sm_90 compile)
        elem = q.element_size()
        if ragged:  # the kernel reads the row block count from the schedule
            if schedule is None:
                schedule = prefill_schedule(cu_seqlens_q, cu_seqlens_kv, T, causal=causal)
            else:
                _check_schedule(schedule, T, B, q.device)
            sched, n_m, n_tiles = schedule.table, 0, 0
            grid = (min(schedule.max_row_blocks * H, sms), 1)
            group = opts.heads_per_group or head_group(H, k.shape[0], dqk + dv, elem, q.device)
        else:
            sched = cu_seqlens_q  # a stand-in, never read
            n_m = -(-max_seqlen_q // BLOCK_M)
            n_tiles = n_m * H * B
            grid = (min(n_tiles, sms), 1) if persistent else (n_m * H, B)
            group = opts.heads_per_group or head_group(H, max_seqlen_kv, dqk + dv, elem, q.device)
        counter = _tile_counter(q.device)
        q_rows = BLOCK_M // 2 if opts.split_q else BLOCK_M  # Q's TMA box: one warpgroup's rows, or the tile's
        v_desc = _descriptor(v, BLOCK_N, dv)
        tma_out = _tma_out(o, q, d1, opts)
        named = dict(
            q_desc=_descriptor(q, q_rows, d1), qt_desc=_descriptor(q, q_rows, tail),
            k_desc=_descriptor(k, BLOCK_N, d1), kt_desc=_descriptor(k, BLOCK_N, tail),
            v_desc=v_desc, o_desc=_descriptor(o, q_rows, dv) if tma_out else v_desc,  # (a stand-in, never read)
            O=o, LSE=lse, CU_Q=cu_seqlens_q, CU_K=cu_seqlens_kv, SCHED=sched,
            H=H, N_M=n_m, N_TILES=n_tiles, head_group=group, COUNTER=counter, stride_ot=o.stride(0),
            stride_oh=o.stride(1), stride_lt=lse.stride(0), scale_log2=softmax_scale * 1.4426950408889634,
            D1=d1, DT=dt, TAIL=tail, DV=dv, TMA_OUT=tma_out, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES,
            CAUSAL=causal,
            PINGPONG=opts.pingpong, DYNAMIC=persistent, RAGGED=ragged, SPLIT_Q=opts.split_q, REVERSE=opts.reverse,
            CONSUMER_REGS=opts.consumer_regs, PRODUCER_REGS=opts.producer_regs, SOURCE_KEY=_SOURCE_KEY,
            num_warps=4)
        pointers = (o, lse, cu_seqlens_q, cu_seqlens_kv, sched, counter)
        key = (q.device, q.dtype, d1, dt, dv, tma_out, causal, opts.pingpong, persistent, ragged, opts.split_q,
               opts.reverse, opts.consumer_regs, opts.producer_regs,
               tuple(_int_key(x) for x in (H, o.stride(0), o.stride(1), lse.stride(0))),
               tuple(t.data_ptr() % 16 == 0 for t in pointers))
        _launch(grid, named, key, opts.fast_launch)
    return (o, lse) if return_lse else o
