"""PNG plots of a results directory (matplotlib, Agg backend, no display needed)."""

from __future__ import annotations

from pathlib import Path

from pdserve.bench.extra import require
from pdserve.bench.plan import BenchPlan, Point
from pdserve.bench.records import BenchRun
from pdserve.bench.summary import curve, records_at

matplotlib = require("matplotlib")
matplotlib.use("Agg")  # before pyplot is imported
plt = require("matplotlib.pyplot")


def write_plots(plan: BenchPlan, runs: dict[Point, BenchRun], out_dir: Path) -> list[Path]:
    """Attainment-vs-rate per SLO and latency distributions at the headline rate; returns the files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [_attainment(plan, runs, slo, out_dir) for slo in plan.slos]
    paths.append(_distributions(plan, runs, out_dir))
    return [p for p in paths if p is not None]


def _attainment(plan: BenchPlan, runs, slo, out_dir: Path) -> Path | None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for config in plan.configs:
        cv = curve(plan, runs, config, slo)
        if cv is None:
            continue
        rates = [r.rate for r in cv.rates]
        means = [r.attainment.fraction for r in cv.rates]
        (line,) = ax.plot(rates, means, marker="o", label=f"{config} (goodput {cv.goodput})")
        ax.fill_between(rates, [r.ci.low for r in cv.rates], [r.ci.high for r in cv.rates],
                        color=line.get_color(), alpha=0.15)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.axhline(plan.target, color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="offered rate (req/s)", ylabel="SLO attainment", ylim=(-0.02, 1.02),
           title=f"SLO {slo}  (band: Wilson 95 % CI, pooled scored requests)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = out_dir / f"attainment_{_slug(slo.name)}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _distributions(plan: BenchPlan, runs, out_dir: Path) -> Path | None:
    rate = plan.headline
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = (("TTFT (ms)", lambda r: r.ttft_ms), ("mean ITL per request (ms)", lambda r: r.mean_itl_ms),
              ("max inter-chunk gap per request (ms)", lambda r: r.max_gap_ms))
    drawn = False
    for config in plan.configs:
        ok = [r for r in records_at(plan, runs, config, rate) if not r.failed]
        if not ok:
            continue
        drawn = True
        for ax, (_, value) in zip(axes, panels):
            values = sorted(value(r) for r in ok)
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=config)
    if not drawn:
        plt.close(fig)
        return None
    for ax, (label, _) in zip(axes, panels):
        ax.set(xlabel=label, ylabel="fraction of requests (CDF)", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Per-request latency distributions at {rate:g} req/s (scored requests, all seeds pooled)")
    path = out_dir / f"distributions_r{rate:g}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text)
