"""The merge of a split decode: each (row, query head)'s partial outputs, weighed by their
log-sum-exps, into one row of ``out``. Both decode kernels (``oscar_attention``'s Triton decode
and ``oscar_decode``) split a request's keys over programs (flash-decoding) and end with it."""
import torch
import triton
import triton.language as tl


# The split count is a runtime argument: the decode launch picks counts that fill one wave of
# programs (any integer, one per batch size), and a compile per count would be dozens of variants.
@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr,  # [T, HQ, D]
    part_out_ptr,  # fp32 [T, HQ, num_splits, D]
    part_lse_ptr,  # fp32 [T, HQ, num_splits]
    num_splits,  # partials per row and head
    stride_ot, stride_oh,
    HQ: tl.constexpr,
    D: tl.constexpr,
    SPLITS_POW2: tl.constexpr,  # num_splits rounded up to a power of two (tl.arange's sizes)
):
    # Splits without keys (a log-sum-exp of -inf) write no partial output: it is never read. The
    # partials go in chunks of at most 32 splits (no [num_splits, D] tile in registers), up to the
    # last used split only: a short request's keys fill the first splits of a count sized for long
    # ones (Gluon decode: 128-256 for one request, 21 used at 1K), and each chunk past them would
    # cost a dependent load of its log-sum-exps for nothing.
    CHUNK: tl.constexpr = SPLITS_POW2 if SPLITS_POW2 < 32 else 32
    t = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1)
    first = (t * HQ + hq) * num_splits
    splits = tl.arange(0, SPLITS_POW2)
    lse_all = tl.load(part_lse_ptr + first + splits, mask=splits < num_splits, other=float("-inf"))
    n_used = tl.max(tl.where(lse_all > float("-inf"), splits + 1, 0), axis=0)
    mx = tl.max(lse_all)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    o = tl.zeros([D], tl.float32)
    w_sum = 0.0
    for c in range(0, n_used, CHUNK):
        split = c + tl.arange(0, CHUNK)
        part = first + split
        lse = tl.load(part_lse_ptr + part, mask=split < num_splits, other=float("-inf"))
        used = lse > float("-inf")
        w = tl.where(used, tl.exp2(lse - mx), 0.0)
        x = tl.load(part_out_ptr + part[:, None] * D + tl.arange(0, D)[None, :], mask=used[:, None], other=0.0)
        o += tl.sum(w[:, None] * x, axis=0)
        w_sum += tl.sum(w, axis=0)
    o = o / tl.maximum(w_sum, 1e-30)
    tl.store(out_ptr + t * stride_ot + hq * stride_oh + tl.arange(0, D), o.to(out_ptr.dtype.element_ty))


def merge_splits(out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor, num_rows: int,
                 num_splits: int) -> torch.Tensor:
    """Rows ``[0, num_rows)`` of ``out`` ``[>= num_rows, Hq, d]`` from their splits' normalized
    partial outputs ``part_out`` (fp32, ``[num_rows, Hq, num_splits, d]`` as one flat run) and
    log2-sum-exp2s ``part_lse`` (fp32, ``[num_rows, Hq, num_splits]``), any ``num_splits >= 1``."""
    hq, d = out.shape[1], out.shape[2]
    _merge_splits_kernel[(num_rows, hq)](
        out_ptr=out, part_out_ptr=part_out, part_lse_ptr=part_lse, num_splits=num_splits, stride_ot=out.stride(0),
        stride_oh=out.stride(1), HQ=hq, D=d, SPLITS_POW2=triton.next_power_of_2(num_splits),
    )
    return out
