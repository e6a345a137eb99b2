"""The two ready-made plans: ``default`` (the full comparison) and ``quick`` (a smoke run).

Why the defaults are what they are (2-core machine, see shared/research/pd-effect-cpu.md):

* Model ``small`` (~107 M parameters, Llama shape): the size measured in the research note, where
  a prefill costs many decode steps, so prefill/decode interference is visible at all.
* ISL 512 / OSL 64 instead of the measured 1024 / 128, at twice the request rates (2-6 req/s
  instead of 1-3): the same prefill and decode tokens per second, the same number of prefills
  landing in one request's lifetime, each stall half as long. That keeps the interesting region
  (round-robin failing on ITL, 1P+1D on TTFT) inside the sweep while each point's arrivals take
  half the time: 80 prompts x 5 rates x 2 seeds is ~230 s of arrivals per configuration, about
  7.5 min per configuration with startup and per-point overhead, ~45 min for all six.
* SLOs: the blog's literal TTFT<1000 ms & mean ITL<50 ms; a tight mean-ITL one (~2x unloaded
  ITL) and a stall one (max inter-chunk gap) with TTFT<500 ms, the research note's 1 s scaled
  to the halved prompt (TTFT under load is a queue at the prefill core, whose service time halved).
* ``chunked``: round-robin with --max-num-batched-tokens tuned over 128/256 (see runner.tune).
"""

from __future__ import annotations

from pdserve.bench.plan import BenchPlan, Workload
from pdserve.bench.slo import SLO
from pdserve.errors import ConfigError

DEFAULT_SLOS = ("blog:ttft<1000,mean_itl<50", "tight:ttft<500,mean_itl<40", "stall:ttft<500,max_gap<100")

PRESETS: dict[str, BenchPlan] = {
    "default": BenchPlan(
        configs=("collocated", "round-robin", "chunked", "write", "read", "nixl"),
        rates=(2.0, 3.0, 4.0, 5.0, 6.0),
        seeds=(1, 2),
        workload=Workload(input_len=512, output_len=64, num_prompts=80),
        slos=tuple(SLO.parse(s) for s in DEFAULT_SLOS),
        model="small",
        headline_rate=5.0,
        chunk_candidates=(128, 256),
    ),
    # Smoke run (~3-4 min): checks the pipeline end to end; tiny model, numbers not meaningful.
    "quick": BenchPlan(
        configs=("collocated", "round-robin"),
        rates=(4.0, 8.0),
        seeds=(1, 2),
        workload=Workload(input_len=256, output_len=32, num_prompts=16),
        slos=tuple(SLO.parse(s) for s in DEFAULT_SLOS),
        model="tiny",
        headline_rate=8.0,
        warmup_prompts=2,
    ),
}


RATIONALE = {
    "default": (
        "Why these defaults: model `small` (~107 M parameters), the size of the research measurements, where one "
        "prefill costs many decode steps so prefill/decode interference shows. ISL 512 / OSL 64 at 2-6 req/s is "
        "the measured 1024 / 128 at 1-3 req/s scaled by two: the same prefill and decode tokens per second and the "
        "same number of prefills per request lifetime, half-length stalls, half the wall time, so the region where "
        "round-robin fails on ITL and 1P+1D on TTFT lies inside the sweep and all six configurations fit in about "
        "45 min (80 requests x 5 rates x 2 seeds each). SLOs: the blog's literal TTFT<1 s & mean ITL<50 ms; a tight "
        "mean-ITL one (~2x unloaded ITL) and a stall one (max gap) with TTFT<500 ms, the research's 1 s scaled to "
        "the halved prompt. Estimates from shared/research/pd-effect-cpu.md, not re-measured at this scale."),
    "quick": "Quick preset: a smoke run of the whole pipeline on the tiny model (~4 min); its numbers mean nothing.",
}


def preset(name: str) -> BenchPlan:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown bench preset {name!r} (known: {', '.join(PRESETS)})") from None
