"""TBQ4: 4.25-bit rotated quantisation of the latent c_kv (llama.cpp-mtp's TBQ4_0, for MLA).

Each block of 128 values is rotated by the orthonormal fast Walsh–Hadamard transform, which
spreads it so that its coordinates look like N(0, 1/128) samples scaled by the block's norm. Each
coordinate of y / ||y|| is coded by the nearest of 16 Lloyd–Max centroids for N(0, 1/√128) (4-bit
index, two per byte), and the block keeps one fp16 "corrected" norm: ||y|| / ||centroids[idx]||,
so that the reconstruction has exactly the block's norm. 2 + 64 bytes per 128 values = 4.125 bits
(4.25 counting the rope part's share in llama.cpp's accounting). A row stores every block's codes
first, then the blocks' norms: the codes start the row, so the decode kernel reads them as aligned
32-bit words (8 codes each) instead of bytes.

Attention can run in the rotated domain: H is orthonormal and symmetric, so q·x = (Hq)·(Hx) and
Σ p·x = H(Σ p·Hx): rotate q's latent part once, score and accumulate against the codes directly,
rotate the output back once.

The centroids are computed here (Lloyd's algorithm on the Gaussian density with closed-form
interval means), not copied from a table.
"""

from __future__ import annotations

import functools
import math

import torch

BLOCK = 128
LEVELS = 16


@functools.lru_cache(maxsize=None)
def lloyd_max_centroids(levels: int = LEVELS, sigma: float = 1 / math.sqrt(BLOCK), iters: int = 300) -> tuple:
    """Optimal (MSE) scalar quantiser for N(0, σ²): alternate boundaries = midpoints of centroids,
    centroids = E[x | boundary interval] = σ² (φ(a) − φ(b)) / (Φ(b) − Φ(a)) in σ units. Returns a
    sorted tuple of floats (float64 accuracy)."""
    c = torch.linspace(-2.5, 2.5, levels, dtype=torch.float64)  # in units of σ
    sqrt2 = math.sqrt(2.0)
    for _ in range(iters):
        b = torch.cat([torch.tensor([-math.inf], dtype=torch.float64), (c[1:] + c[:-1]) / 2,
                       torch.tensor([math.inf], dtype=torch.float64)])
        pdf = torch.exp(-0.5 * b**2) / math.sqrt(2 * math.pi)
        pdf = torch.where(torch.isinf(b), torch.zeros_like(pdf), pdf)
        cdf = 0.5 * (1 + torch.special.erf(b / sqrt2))
        c = (pdf[:-1] - pdf[1:]) / (cdf[1:] - cdf[:-1])
    return tuple((c * sigma).tolist())


_CENTROIDS: dict = {}


def code_centroids() -> tuple:
    """The 16 centroids in code order: code = 8·sign + magnitude rank, i.e. the 8 positive centroids from the
    smallest up, then their negatives. The centroids are symmetric, so a code's e4m3 / bf16 value is a magnitude
    from an 8-entry table with the code's fourth bit as the sign bit: the register kernel's decode needs one
    table register and no selection between table halves (`e4m3_lookup_ptx`)."""
    c = lloyd_max_centroids()
    positive = c[LEVELS // 2:]
    return tuple(positive) + tuple(-x for x in positive)


def centroids(device=None, dtype=torch.float32) -> torch.Tensor:
    """The 16 centroids in code order (`code_centroids`) as a tensor, made once per (device, dtype): a fresh
    host→device copy on every call could not be captured in a CUDA graph."""
    key = (str(torch.device(device) if device is not None else "cpu"), dtype)
    if key not in _CENTROIDS:
        _CENTROIDS[key] = torch.tensor(code_centroids(), device=device, dtype=dtype)
    return _CENTROIDS[key]


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh–Hadamard transform over the last dim (a power of two); self-inverse."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"FWHT size must be a power of two, got {n}")
    y = x.reshape(-1, n).float()
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2).view(-1, n)
        h *= 2
    return (y / math.sqrt(n)).view(x.shape)


def centroid_lookup_ptx(scaled: bool, dtype: torch.dtype = torch.bfloat16) -> str:
    """PTX that turns one 32-bit word of 8 codes into the bf16 centroids of its coordinates, by byte permutes
    on register tables (llama.cpp's 16-entry `__byte_perm` lookup, for 16-bit values): the low and the high
    bytes of the 16 bf16 centroids are two 16-byte tables; a 3-bit selector picks among 8 entries, the
    code's fourth bit picks the table half.

    scaled (the Triton kernel): each value times the block norm, $8 = codes, $9 = the norm as bf16 in both
    halves, $0..$7 = coordinates 0..7 of the word. Unscaled (the Gluon kernels): $4 = codes, $0..$3 = the pairs
    of coordinates (0, 1), (2, 3), (4, 5), (6, 7), in `dtype` (bf16 or fp16) pairs."""
    if scaled and dtype != torch.bfloat16:
        raise ValueError("the scaled lookup multiplies in bf16 (fma.rn.bf16x2): its table must be bf16")
    bits = torch.tensor(code_centroids(), dtype=dtype).view(torch.int16).tolist()
    lo = [b & 0xFF for b in bits]
    hi = [(b >> 8) & 0xFF for b in bits]

    def word(t, i):
        return hex(t[4 * i] | t[4 * i + 1] << 8 | t[4 * i + 2] << 16 | t[4 * i + 3] << 24)

    tables = "".join(f"mov.b32 tl{i}, {word(lo, i)}; mov.b32 tg{i}, {word(hi, i)};\n" for i in range(4))
    lookup = """prmt.b32 ta, tl0, tl1, ts; prmt.b32 tc, tl2, tl3, ts; prmt.b32 tlo, ta, tc, th;
prmt.b32 ta, tg0, tg1, ts; prmt.b32 tc, tg2, tg3, ts; prmt.b32 thi, ta, tc, th;
"""
    if scaled:
        codes, setup, outs = "$8", "mov.b32 tz, 0x80008000;\n", [(0, 1), (2, 3), (4, 5), (6, 7)]
        pair = "prmt.b32 tp, tlo, thi, {sel}; fma.rn.bf16x2 tp, tp, $9, tz; mov.b32 {{${a}, ${b}}}, tp;\n"
    else:
        codes, setup, outs = "$4", "", [(0,), (1,), (2,), (3,)]
        pair = "prmt.b32 ${a}, tlo, thi, {sel};\n"

    def four(first, second):  # four coordinates' lookup, then their two output pairs
        return lookup + "".join(pair.format(sel=sel, a=o[0], b=o[-1]) for sel, o in (("0x5140", first),
                                                                                   ("0x7362", second)))

    return ("{\n.reg .b32 tl0, tl1, tl2, tl3, tg0, tg1, tg2, tg3, ts, th, tt, ta, tc, tlo, thi, tp, tz;\n" + tables +
            setup + f"and.b32 ts, {codes}, 0x77777777;\nand.b32 tt, {codes}, 0x88888888;\n"
            "shr.b32 tt, tt, 1;\nor.b32 th, tt, 0x32103210;\n" + four(outs[0], outs[1]) +
            "shr.b32 ts, ts, 16;\nshr.b32 th, th, 16;\n" + four(outs[2], outs[3]) + "}")


@functools.lru_cache(maxsize=None)
def e4m3_centroids() -> tuple:
    """The centroids as e4m3 codes of centroid·k, with k (a power of two times 1…2) the one that rounds them best:
    the largest relative error is then 2 % (on a 3-bit mantissa's grid it could be 6 %), against the 9.6 % of the
    4-bit quantisation itself. Returns (k, the 16 codes as ints, in code order). For kernels that feed the codes to
    e4m3 matmuls and fold 1/k into the block norms."""
    mag = torch.tensor(code_centroids(), dtype=torch.float64).abs()
    best = None
    for u in torch.linspace(1, 2, 2001, dtype=torch.float64)[:-1].tolist():
        k = u * 64.0  # |centroid·k| between 0.7 and 31: normal e4m3 numbers
        v = mag * k
        err = ((v.float().to(torch.float8_e4m3fn).double() - v) / v).abs().max().item()
        if best is None or err < best[0]:
            best = (err, k)
    k = best[1]
    codes = (torch.tensor(code_centroids(), dtype=torch.float64) * k).float().to(torch.float8_e4m3fn)
    return k, tuple(codes.view(torch.uint8).tolist())


def e4m3_lookup_ptx() -> str:
    """PTX that turns one 32-bit word of 8 codes into their 8 centroids·k as e4m3 bytes ($2 → $0: coordinates 0…3,
    $1: 4…7; k from `e4m3_centroids`), 9 instructions per word. A code is 8·sign + magnitude rank
    (`code_centroids`): one byte permute picks four magnitudes from the 8-entry table (two registers, one of them an
    immediate in the SASS), a second one in sign-replicating mode turns the four codes' fourth bits into 0x00 / 0xFF
    bytes (the bits sit at byte tops in the word or in the word shifted left by 4), and one lop3 puts those bytes'
    top bits on the magnitudes (e4m3's sign bit)."""
    _, codes = e4m3_centroids()
    t0 = codes[0] | codes[1] << 8 | codes[2] << 16 | codes[3] << 24
    t1 = codes[4] | codes[5] << 8 | codes[6] << 16 | codes[7] << 24
    # sign selectors: output byte j takes the top bit of the byte holding code j's fourth bit, with bit 3 set
    # (replicate): code 0 → byte 0 of w << 4 (index 4), code 1 → byte 0 of w, code 2 → 5, code 3 → 1; then 6, 2, 7, 3
    return ("{\n.reg .b32 t0, t1, ts, tw, tm, tg;\n" + f"mov.b32 t0, {hex(t0)};\nmov.b32 t1, {hex(t1)};\n"
            "and.b32 ts, $2, 0x77777777;\nshl.b32 tw, $2, 4;\n"
            "prmt.b32 tm, t0, t1, ts;\nprmt.b32 tg, $2, tw, 0x9D8C;\nlop3.b32 $0, tg, 0x80808080, tm, 0xEA;\n"
            "shr.u32 ts, ts, 16;\n"
            "prmt.b32 tm, t0, t1, ts;\nprmt.b32 tg, $2, tw, 0xBFAE;\nlop3.b32 $1, tg, 0x80808080, tm, 0xEA;\n}")


_HADAMARD: dict = {}


def hadamard(device=None) -> torch.Tensor:
    """The orthonormal 128×128 Sylvester Hadamard matrix (x @ H == fwht(x)), fp32, cached per device."""
    key = str(device)
    if key not in _HADAMARD:
        _HADAMARD[key] = fwht(torch.eye(BLOCK)).to(device).contiguous()
    return _HADAMARD[key]


def rotate_blocks(x: torch.Tensor) -> torch.Tensor:
    """FWHT on each 128-wide block of the last dim, in fp32, as one matmul by the Hadamard matrix (the
    butterflies of `fwht` are about 25 small kernels)."""
    *lead, d = x.shape
    if d % BLOCK:
        raise ValueError(f"width {d} is not a multiple of {BLOCK}")
    return (x.reshape(-1, BLOCK).float() @ hadamard(x.device)).reshape(*lead, d)


def quantize(c_kv: torch.Tensor) -> torch.Tensor:
    """[T, Dc] → uint8 [T, (Dc/128)·66]: the 4-bit centroid indices of every block (64 bytes per
    block, low nibble = even coordinate), then one fp16 corrected norm per block."""
    T, dc = c_kv.shape
    nb = dc // BLOCK
    y = rotate_blocks(c_kv.float()).view(T, nb, BLOCK)
    norm = y.norm(dim=-1, keepdim=True)
    unit = y / norm.clamp_min(1e-30)
    cent = centroids(c_kv.device)
    idx = (unit[..., None] - cent).abs().argmin(-1)  # [T, nb, 128]
    recon_norm = cent[idx].norm(dim=-1, keepdim=True)
    d = (norm / recon_norm.clamp_min(1e-30)).to(torch.float16)  # corrected norm
    packed = (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8)  # [T, nb, 64]
    d_bytes = d.view(torch.uint8).view(T, nb * 2)
    return torch.cat([packed.reshape(T, nb * BLOCK // 2), d_bytes], dim=-1)


def dequantize_rotated(q: torch.Tensor, dc: int) -> torch.Tensor:
    """uint8 rows → the rotated-domain reconstruction [T, Dc] fp32 (centroid · corrected norm)."""
    T = q.shape[0]
    nb = dc // BLOCK
    codes_end = nb * BLOCK // 2
    d = q[:, codes_end : codes_end + 2 * nb].contiguous().view(torch.float16).float().view(T, nb, 1)
    packed = q[:, :codes_end].long().view(T, nb, BLOCK // 2)
    idx = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(T, nb, BLOCK)
    return (centroids(q.device)[idx] * d).view(T, dc)


def dequantize(q: torch.Tensor, dc: int) -> torch.Tensor:
    """uint8 rows → [T, Dc] fp32 in the original domain."""
    return rotate_blocks(dequantize_rotated(q, dc))


def row_bytes(dc: int) -> int:
    return (dc // BLOCK) * (2 + BLOCK // 2)


def norms_offset(dc: int) -> int:
    """Byte offset of the first block norm in a row (the codes come first)."""
    return dc // 2


ALIGN = 16  # bytes: TMA copies need 16-byte-aligned fields and row strides


def rope_offset(dc: int) -> int:
    """Byte offset of the bf16 rope part in a cache row: after the codes and norms, padded to 16 bytes."""
    return -(-row_bytes(dc) // ALIGN) * ALIGN


def cache_row_bytes(dc: int, dr: int) -> int:
    """Bytes of one tbq4 cache row, [codes | norms | pad | rope (bf16) | pad], a multiple of 16 (400 for
    Dc = 512, Dr = 64) so that every field and every row starts 16-byte aligned: TMA boxes and 16-byte vector
    loads can copy them (392-byte rows could only be read in 8-byte pieces)."""
    return -(-(rope_offset(dc) + 2 * dr) // ALIGN) * ALIGN
