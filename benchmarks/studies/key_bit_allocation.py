"""Keys with their bits where the queries look: a page-format candidate for issue 19 (CPU study).

    python -m benchmarks.studies.key_bit_allocation --windows 1 --out results/quality/key_bits  # ~30 min, 2 CPU cores

OSCAR's key rotation is ``R_K = U H P``: the eigenvectors ``U`` of the query moment ``C_Q``, then
a Hadamard ``H`` that spreads every eigen-direction over all dims, so that one 2-bit min-max grid
per row fits them all. But a key's logit error is ``Σ_i e_i Δk_i²`` in the eigenbasis (``e_i`` the
query energy along ``u_i``), and in the SmolLM2 layers looked at (docs/quality.md) the top 8 of 64
directions hold 55-69% of it, the bottom 8 0.4-3%. Transform coding says spend the bits there: keep
``U``, sort its directions by ``e_i`` times the keys' own variance along them, give the first units
of 8 directions 4 or 3 bits and the last 1 or 0 (2 bits a direction on average, the codes the same
16 bytes a row at head_dim 64), and mix each group of equal bits with a Hadamard of its own (sizes
that are sums of powers of two) so one grid per group fits it. Per layer the pattern of bits is the
one with the smallest held-out logit error of all patterns (``bit_patterns``).

Two ways to store a row's range: ``groups`` gives every group of 2 bits or more its own fp16
scale and minimum (more parameter bytes than today's page: its figures are a ceiling), ``one
scale`` stores one fp16 scale per row (``max |k - μ|`` around the calibrated column means ``μ``)
and a calibrated share of it per group, 16 bits a row against today's 32: fewer bytes than
today's page. 1-bit groups store the sign around ``μ``; 0-bit directions read ``μ``. Values stay
as today (OSCAR's rotation, 2 bits, fitted clip): the row with BF16 keys says how little of the
error is theirs.

Rows, scored as ``quality_study.py`` scores (decode reads, sink 64, recent 256, the logit
correction at today's λ = 0.5 unless the row names another, its variance per direction from what
the row stores): today's cache; keys in BF16 (what any key format can at most gain); the two
stores above with the layer's basis and with one basis per KV head (``PerHeadKeys``); the groups
store at λ = 0.25 and 1. The fit's held-out key logit error per layer against today's goes to
``fit`` in the JSON. Scores are cached in ``--cache`` with quality_study's (the same BF16 and
today's rows).
"""
from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from benchmarks import quality_study as qs
from oscar_vllm.calibration import corpus
from oscar_vllm.calibration.evaluate import environment, report_header, save_report
from oscar_vllm.calibration.fit import LayerStats
from oscar_vllm.core.mixed_cache import LayerCacheSpec, RowQuantizer
from oscar_vllm.core.quant import minmax_dequantize, minmax_quantize
from oscar_vllm.core.rotation import apply_rotation, hadamard, key_moment

UNIT = 8  # directions per allocation unit: a group is then a sum of Hadamard blocks of 8 and up
MAX_BITS = 4
RATIO_STEPS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.1, 1.25)  # one-scale: multiples of each group's mean share tried
LOGIT_CORRECTION = 0.5


def block_hadamard(n: int) -> torch.Tensor:
    """Block-diagonal orthonormal Hadamard ``[n, n]`` over the binary decomposition of ``n``."""
    blocks, left = [], n
    while left:
        size = 1 << (left.bit_length() - 1)
        blocks.append(hadamard(size))
        left -= size
    return torch.block_diag(*blocks)


def bit_patterns(head_dim: int) -> list[tuple[int, ...]]:
    """Bits per unit of ``UNIT`` directions, most important first (non-increasing), 0 to
    ``MAX_BITS``, averaging 2 bits a direction: the codes take as many bytes as today's."""
    units = head_dim // UNIT
    return [p for p in itertools.combinations_with_replacement(range(MAX_BITS, -1, -1), units) if sum(p) == 2 * units]


@dataclass
class EigenBitKeys:
    """One layer's keys in the allocated basis. ``rotation`` ``[d, d]`` (columns: the directions,
    grouped by bits); ``groups`` (column indices, bits); ``mu``/``col_var`` ``[d]``: the calibrated
    mean and variance of each column; ``ratios``: per group, its half range as a share of the row
    scale (``None``: a min-max scale and minimum per group instead)."""

    rotation: torch.Tensor
    groups: list[tuple[torch.Tensor, int]]
    mu: torch.Tensor
    col_var: torch.Tensor
    ratios: list[float] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantize(x)[0]

    def rounding_variance(self, x: torch.Tensor) -> torch.Tensor:
        """Per element (``[..., d]``): what the logit correction subtracts, from stored numbers only."""
        return self.quantize(x)[1]

    def row_bits(self) -> int:
        codes = sum(len(cols) * bits for cols, bits in self.groups)
        if self.ratios is not None:
            return codes + 16
        return codes + sum(32 if bits >= 2 else 16 if bits == 1 else 0 for _, bits in self.groups)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dequantized, rounding variance)``, fp32 ``[..., d]``, of rows already rotated."""
        x = x.float()
        mu, col_var = self.mu.to(x.device).float(), self.col_var.to(x.device).float()
        centered = x - mu
        if self.ratios is not None:
            row_scale = centered.abs().amax(-1, keepdim=True).to(torch.float16).float().clamp(min=1e-8)
        out, var = torch.empty_like(x), torch.empty_like(x)
        for g, (cols, bits) in enumerate(self.groups):
            c = centered[..., cols]
            if bits == 0:
                out[..., cols], var[..., cols] = mu[cols].expand_as(c), col_var[cols].expand_as(c)
            elif bits == 1:  # sign around the mean; |x| Gaussian-like: E[(x - a·sign x)²] = a²(π/2 - 1)
                half = c.abs().mean(-1, keepdim=True) if self.ratios is None else row_scale * self.ratios[g]
                half = half.to(torch.float16).float()
                out[..., cols] = torch.where(c >= 0, half, -half) + mu[cols]
                var[..., cols] = (half.square() * (torch.pi / 2 - 1)).expand_as(c)
            elif self.ratios is None:
                codes, scale, low = minmax_quantize(c, bits)
                scale, low = scale.to(torch.float16), low.to(torch.float16)
                out[..., cols] = minmax_dequantize(codes, scale, low) + mu[cols]
                var[..., cols] = (scale.float().square() / 12).expand_as(c)
            else:
                half = row_scale * self.ratios[g]
                step = 2 * half / ((1 << bits) - 1)
                codes = torch.clamp(torch.round((c + half) / step), 0, (1 << bits) - 1)
                out[..., cols] = codes * step - half + mu[cols]
                var[..., cols] = (step.square() / 12).expand_as(c)
        return out, var


@dataclass
class PerHeadKeys:
    """One :class:`EigenBitKeys` per KV head (its own basis, pattern and shares), on ``[..., Hkv, d]``."""

    heads: list[EigenBitKeys]

    @property
    def rotation(self) -> torch.Tensor:
        return torch.stack([h.rotation for h in self.heads])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantize(x)[0]

    def rounding_variance(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantize(x)[1]

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [h.quantize(x[..., i, :]) for i, h in enumerate(self.heads)]
        return torch.stack([p[0] for p in parts], -2), torch.stack([p[1] for p in parts], -2)

    def row_bits(self) -> float:
        return sum(h.row_bits() for h in self.heads) / len(self.heads)


def head_stats(stats: LayerStats, h: int) -> LayerStats:
    """KV head ``h`` of a layer's statistics, as a layer of one head."""
    one = LayerStats(num_kv_heads=1, qtq_sum=stats.qtq_sum[h:h + 1], query_rows=stats.query_rows)
    one.keys = [k[:, h:h + 1] for k in stats.keys]
    one.values = [v[:, h:h + 1] for v in stats.values]
    return one


def allocated_keys(order: torch.Tensor, u: torch.Tensor, pattern: tuple[int, ...],
                   calib_keys: torch.Tensor) -> EigenBitKeys:
    """The basis and groups of ``pattern`` over the eigen-directions ``u[:, order]``."""
    by_bits: dict[int, list[int]] = {}
    for unit, bits in enumerate(pattern):
        by_bits.setdefault(bits, []).extend(order[unit * UNIT:(unit + 1) * UNIT].tolist())
    columns, groups, start = [], [], 0
    for bits in sorted(by_bits, reverse=True):
        dirs = by_bits[bits]
        columns.append(u[:, dirs] @ block_hadamard(len(dirs)))
        groups.append((torch.arange(start, start + len(dirs)), bits))
        start += len(dirs)
    rotation = torch.cat(columns, dim=1)
    rotated = calib_keys.double() @ rotation
    mu = rotated.mean(dim=(0, 1))
    return EigenBitKeys(rotation, groups, mu, (rotated - mu).square().mean(dim=(0, 1)))


def logit_error(heldout: LayerStats, rotation: torch.Tensor, quant) -> float:
    """Held-out ``E[(q·Δk)²]`` summed over KV heads: the measure the clip fit uses."""
    r = rotation.double()
    keys = apply_rotation(heldout.all_keys().double(), r)
    moment = r.transpose(-1, -2) @ heldout.qtq().double() @ r  # [Hkv, d, d]
    delta = (quant(keys).double() - keys).transpose(0, 1)
    return ((delta @ moment) * delta).sum().item() / keys.shape[0]


def fit_layer(calib: LayerStats, heldout: LayerStats) -> tuple[EigenBitKeys, EigenBitKeys, dict]:
    """The pattern of least held-out logit error (per-group ranges), and its one-scale store with
    each group's share of the row scale fitted one group at a time."""
    e, u = torch.linalg.eigh(key_moment(calib.qtq_sum, calib.query_rows, per_head=False))
    keys = calib.all_keys().double()
    importance = e.clamp(min=0) * (keys @ u).square().mean(dim=(0, 1))
    order = torch.argsort(importance, descending=True)
    scored = []
    for pattern in bit_patterns(u.shape[0]):
        q = allocated_keys(order, u, pattern, keys)
        scored.append((logit_error(heldout, q.rotation, q), pattern, q))
    err, pattern, best = min(scored, key=lambda s: s[0])

    centered = keys @ best.rotation - best.mu
    row_scale = centered.abs().amax(-1, keepdim=True)
    shares = [((centered[..., cols].abs().mean(-1, keepdim=True) if bits == 1
                else centered[..., cols].abs().amax(-1, keepdim=True)) / row_scale).mean().item()
              for cols, bits in best.groups]
    one = EigenBitKeys(best.rotation, best.groups, best.mu, best.col_var, shares)
    one_err = logit_error(heldout, one.rotation, one)
    for g, (_, bits) in enumerate(best.groups):
        if bits == 0:
            continue
        for step in RATIO_STEPS:
            trial = EigenBitKeys(one.rotation, one.groups, one.mu, one.col_var,
                                 [r * step if i == g else r for i, r in enumerate(one.ratios)])
            trial_err = logit_error(heldout, trial.rotation, trial)
            if trial_err < one_err:
                one, one_err = trial, trial_err
    return best, one, {"pattern": pattern, "groups_error": err, "one_scale_error": one_err,
                       "groups_row_bits": best.row_bits(), "one_scale_row_bits": one.row_bits()}


def fit_layer_per_head(calib: LayerStats, heldout: LayerStats) -> tuple[PerHeadKeys, PerHeadKeys, dict]:
    """:func:`fit_layer` for every KV head alone: the errors are the heads' sums."""
    fits = [fit_layer(head_stats(calib, h), head_stats(heldout, h)) for h in range(calib.num_kv_heads)]
    return (PerHeadKeys([f[0] for f in fits]), PerHeadKeys([f[1] for f in fits]),
            {"patterns": [f[2]["pattern"] for f in fits], "groups_error": sum(f[2]["groups_error"] for f in fits),
             "one_scale_error": sum(f[2]["one_scale_error"] for f in fits)})


def report(rows: dict, fit: list[dict], meta: dict) -> str:
    lines = ["# Keys with their bits where the queries look (SmolLM2, decode reads)", "", *report_header(meta),
             f"- evaluation: {meta['windows']} window(s) of 8,192 tokens of {meta['eval_corpus']}; at 2K and 4K "
             "the windows' first positions; every row with the logit correction at λ = 0.5 but where its name "
             "gives another",
             f"- calibration: {meta['calibration']}", "",
             "| row | key bits a row (d=64) | key logit error vs today | ΔPPL 2K | ΔPPL 4K | ΔPPL 8K "
             "| KL 2K | KL 4K | KL 8K | top-1 2K | top-1 4K | top-1 8K |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        c = r["contexts"]
        lines.append(f"| {name} | {r['key_row_bits']} | {r['key_error_vs_today']} | "
                     + " | ".join(f"{c[str(x)]['delta_ppl_pct']:+.2f}%" for x in qs.TABLE_CONTEXTS) + " | "
                     + " | ".join(f"{c[str(x)]['kl']:.4f}" for x in qs.TABLE_CONTEXTS) + " | "
                     + " | ".join(f"{100 * c[str(x)]['top1']:.2f}%" for x in qs.TABLE_CONTEXTS) + " |")
    patterns = sorted({tuple(f["pattern"]) for f in fit})
    lines += ["", "Bit patterns chosen (bits per 8 directions, most important first): "
              + "; ".join(f"{''.join(map(str, p))} in {sum(tuple(f['pattern']) == p for f in fit)} layers"
                          for p in patterns),
              ""]
    return "\n".join(lines)


def plot(results: dict, meta: dict, path: Path) -> None:
    """ΔPPL and KL against the context, a line per row (today's in black)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, key, label in ((axes[0], "delta_ppl_pct", "ΔPPL vs BF16 cache (%)"),
                           (axes[1], "kl", "KL(BF16 ‖ row), nats")):
        for name, r in results.items():
            style = dict(lw=2.2, color="k") if name == "debiased-half" else dict(lw=1.2)
            ax.plot(qs.CONTEXTS, [r["contexts"][str(c)][key] for c in qs.CONTEXTS], marker="o", label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(qs.CONTEXTS, [f"{c // 1024}K" for c in qs.CONTEXTS])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].axhline(2.5, color="tab:red", ls=":", lw=1)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"keys with their bits where the queries look: {meta['model']}, {meta['windows']} x {qs.WINDOW:,} "
                 f"tokens; {meta['date']}, {meta['hardware']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=1, help="evaluation windows of 8,192 tokens (default: 1)")
    parser.add_argument("--out", type=Path, default=qs.REPO / "results" / "quality" / "key_bits")
    parser.add_argument("--cache", type=Path, default=qs.REPO / "runs" / "quality_cache")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    t0 = time.time()

    lm = qs.load_model(device=args.device)
    n = lm.shape.num_layers
    committed = qs.load_rotations(qs.REPO / "tests" / "data" / "smollm2_rotations", lm.shape)
    calibrate = qs.Calibrator(lm, args.cache)
    austen = qs.AUSTEN
    calib = calibrate.capture(austen.text, 0, austen.tokens, austen.seq_len, False)
    heldout = calibrate.capture(austen.text, austen.tokens, austen.heldout, austen.seq_len, False)

    today = qs.Row("x", "x").specs(committed, set(), n)
    fit, groups, one_scale, head_groups, head_one_scale = [], {}, {}, {}, {}
    for i in tqdm(range(n), desc="fitting key bits", unit="layer"):
        groups[i], one_scale[i], f = fit_layer(calib[i], heldout[i])
        head_groups[i], head_one_scale[i], fh = fit_layer_per_head(calib[i], heldout[i])
        f["today_error"] = logit_error(heldout[i], today[i].key_rotation, today[i].key_quant)
        fit.append({"layer": i, **f, "per_head": fh})
    calibrate.forget_captures()

    bf16 = RowQuantizer("bf16")

    def spec(i: int, quant=None, correction: float = LOGIT_CORRECTION) -> LayerCacheSpec:
        s = today[i]
        rotation = s.key_rotation if quant is None or quant is bf16 else quant.rotation.float()
        return LayerCacheSpec(rotation, s.value_rotation, quant or s.key_quant, s.value_quant, correction)

    def mean_ratio(key: str, per_head: bool = False) -> float:
        return sum((f["per_head"] if per_head else f)[key] / f["today_error"] for f in fit) / n

    def mean_bits(stores: dict) -> float:
        return sum(q.row_bits() for q in stores.values()) / n

    configs = {"bf16": ({i: LayerCacheSpec(None, None, bf16, bf16) for i in range(n)}, 0, 0)}
    rows = {  # name: (specs, key bits a row, key error against today's: per-layer ratios' mean)
        "debiased-half": ({i: spec(i) for i in range(n)}, lm.shape.head_dim * 2 + 32, 1.0),
        "keys-bf16": ({i: spec(i, bf16) for i in range(n)}, lm.shape.head_dim * 16, 0.0),
        "eigen-bits-groups": ({i: spec(i, groups[i]) for i in range(n)}, mean_bits(groups), mean_ratio("groups_error")),
        "eigen-bits-one-scale": ({i: spec(i, one_scale[i]) for i in range(n)}, mean_bits(one_scale),
                                 mean_ratio("one_scale_error")),
        "eigen-bits-groups-per-head": ({i: spec(i, head_groups[i]) for i in range(n)}, mean_bits(head_groups),
                                       mean_ratio("groups_error", per_head=True)),
        "eigen-bits-one-scale-per-head": ({i: spec(i, head_one_scale[i]) for i in range(n)}, mean_bits(head_one_scale),
                                          mean_ratio("one_scale_error", per_head=True)),
        "eigen-bits-groups-λ0.25": ({i: spec(i, groups[i], 0.25) for i in range(n)}, mean_bits(groups),
                                    mean_ratio("groups_error")),
        "eigen-bits-groups-λ1": ({i: spec(i, groups[i], 1.0) for i in range(n)}, mean_bits(groups),
                                 mean_ratio("groups_error")),
    }
    for name, (specs, _, _) in rows.items():
        configs[name] = (specs, 64, 256)
    eval_ids = corpus.tokenize(lm.tokenizer, corpus.evaluation_text())[: args.windows * qs.WINDOW]
    windows = [eval_ids[w * qs.WINDOW:(w + 1) * qs.WINDOW] for w in range(args.windows)]
    scores = qs.Study(lm, windows, args.cache).run(configs)

    results = {name: {"key_row_bits": round(bits, 1), "key_error_vs_today": round(err, 3),
                      "contexts": {str(c): qs.summarize(scores[name], scores["bf16"], c) for c in qs.CONTEXTS}}
               for name, (_, bits, err) in rows.items()}
    meta = {**environment("python -m benchmarks.studies.key_bit_allocation"), "model": lm.name, "dtype": "float32",
            "windows": args.windows,
            "eval_corpus": corpus.EVALUATION_NAME,
            "calibration": f"{austen.tokens:,} tokens of {corpus.CALIBRATION_NAME} for the bases, {austen.heldout:,} "
                           "more for the patterns and shares (today's rotations: the committed ones)",
            "seconds": round(time.time() - t0)}
    save_report(args.out, "key_bits", {"meta": meta, "rows": results, "fit": fit}, report(results, fit, meta))
    plot(results, meta, args.out / "key_bits.png")


if __name__ == "__main__":
    main()
