"""The OSCAR paged KV layout and the small device helpers both kernels share.

One cache slot holds one (token, KV head) of one layer, ``int2_slot_bytes(d)`` bytes::

    [0, d/4)         K codes, quartered INT2 (byte j: dims j, j+d/4, j+d/2, j+3d/4)
    [d/4, d/2)       V codes, same packing
    [d/2, d/2 + 8)   K scale, K min, V scale, V min: 16-bit floats, little endian

A layer's cache is a uint8 tensor ``[num_blocks, block_size, num_kv_heads, slot_bytes]``.
The 16-bit parameters are assembled from bytes so that the kernels need no pointer casts
(and behave the same under ``TRITON_INTERPRET=1``).

The BF16 windows live beside it, per running request ("ring slot"):
``window_k``/``window_v`` ``[num_slots, sink + recent, num_kv_heads, d]`` bf16 and
``window_pos`` ``[num_slots, sink + recent]`` int32, the position each entry holds
(-1: empty). Position ``p`` lives at index ``p`` if ``p < sink``, else at
``sink + (p - sink) % recent``. A reader trusts an entry only when ``window_pos`` equals
the position it wants, so a stale or missing entry falls back to the INT2 copy.
"""
import triton
import triton.language as tl

PARAM_BYTES = 8


def int2_slot_bytes(head_dim: int) -> int:
    """Bytes of one (token, KV head) slot: K and V codes plus four 16-bit parameters."""
    if head_dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4 to pack INT2, got {head_dim}")
    return head_dim // 2 + PARAM_BYTES


@triton.jit
def find_request(cu_q_ptr, num_reqs, target, BLOCK_Q: tl.constexpr, Q_BLOCK_MODE: tl.constexpr):
    """The request holding token ``target`` (or q-block ``target`` in q-block mode).

    ``cu_q_ptr``: int32 ``[num_reqs + 1]`` query start offsets. In q-block mode request ``r``
    owns q-blocks starting at ``cu_q[r] // BLOCK_Q + r``.
    """
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid)
        if Q_BLOCK_MODE:
            start = start // BLOCK_Q + mid
        if start <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def window_index(pos, SINK: tl.constexpr, RECENT: tl.constexpr):
    """Index of position ``pos`` in a request's window ring."""
    return tl.where(pos < SINK, pos, SINK + (pos - SINK) % RECENT)


@triton.jit
def load_f16_param(ptr, offset, mask, PARAM_BF16: tl.constexpr):
    """A 16-bit float stored as two bytes at ``ptr + offset`` -> fp32."""
    lo = tl.load(ptr + offset, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + offset + 1, mask=mask, other=0).to(tl.uint16)
    bits = lo | (hi << 8)
    if PARAM_BF16:
        return bits.to(tl.bfloat16, bitcast=True).to(tl.float32)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def bf16_bits_rne(x):
    """fp32 -> bf16 bit pattern (uint16), rounding to nearest even.

    Spelled out in integers because the interpreter's ``.to(tl.bfloat16)`` truncates
    (whatever ``fp_downcast_rounding`` says), and CPU tests must round like the GPU.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16)


@triton.jit
def to_bf16_rne(x):
    """fp32 -> bf16, rounding to nearest even on the GPU and in the interpreter alike."""
    return bf16_bits_rne(x).to(tl.bfloat16, bitcast=True)


@triton.jit
def store_f16_param(ptr, offset, value, PARAM_BF16: tl.constexpr):
    """Store fp32 ``value`` as a 16-bit float in two bytes at ``ptr + offset``."""
    if PARAM_BF16:
        bits = bf16_bits_rne(value)
    else:
        bits = value.to(tl.float16).to(tl.uint16, bitcast=True)
    tl.store(ptr + offset, (bits & 0xFF).to(tl.uint8))
    tl.store(ptr + offset + 1, (bits >> 8).to(tl.uint8))
