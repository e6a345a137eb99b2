"""The ready-made plans (``default``: the full comparison; ``quick``: the product in a few minutes)
and the named workloads of ``--workload``.

Why the defaults are what they are (2-core machine, see shared/research/pd-effect-cpu.md and the
audit of the first committed run):

* Model ``small`` (~107 M parameters, Llama shape), where a prefill costs many decode steps, so
  prefill/decode interference is visible at all. ISL 512 / OSL 64.
* Rates follow the machine: a calibration measures prefill and decode step times on a plain
  instance and estimates the capacity (calibrate.py); the grid is geometric, 0.2-0.9 of it (x1.5
  a step), because where the knees fall as a fraction of that estimate depends on the CPU (from
  below 0.4 to 0.85 of it on the machines measured). Tuning and the headline table run at 0.3, a rate where the configurations still pass.
* Fair comparison: every configuration gets the same request streams (3 seeds; arrivals.py) and
  the same tuning procedure over its token budgets, vLLM's default included (tune.py): collocated
  and round-robin over their chunk size (``chunked`` is round-robin with a fixed one and is not in
  the default list any more), write/read over the prefill budget, adaptive (P at 512, one prompt
  per step) over whether the prefill instance also serves whole requests (``+serve``, for
  decode-heavy traffic); decode's local chunk is not tuned, it follows decode's streams
  (placement/chunk_size.py). ``read`` is not in the default list (``--configs`` adds it, tuned the same
  way): the claim measured is adaptive against plain serving and static write.
* Interleaved: each seed is a round in which every configuration runs in a deployment of its own,
  the order rotating (BenchPlan.rounds): on these shared machines the same configuration moved by
  ~10 ms of ITL between deployments minutes apart, and run one after another that drift lands on
  whichever configuration ran last.
* 30 requests per point, the first 20 % and last 10 % of the arrival span not scored (~21 scored,
  ~63 per rate over the seeds). Calibration, 8 tuning deployments, 18 measured ones, 90 points
  (runner.estimate_s; the low rates take longest).
* SLOs: the blog's TTFT<1 s & mean ITL<50 ms; a tight mean-ITL one; stall ones bounding the largest
  inter-chunk gap (100 ms with TTFT<500 ms or <1 s; 50 ms with TTFT<1 s), where decode smoothness
  is the objective.
* Adaptive's decode instance keeps its streams' mean ITL under 50 ms and no step of its streams
  over 50 ms (placement/policy.py, chunk_size.py): the bounds of the gap50 SLO. ``adaptive@NAME`` declares
  the SLO NAME instead (``pdserve up --slo``, slo_targets.py): blog and tight bound the mean ITL only
  (50, 40 ms), so D prefills a prompt whole beside its streams where P's queue makes that faster, as
  plain serving does; stall and stall1s bound steps at 100 ms, gap50 at adaptive's own 50 ms, so
  adaptive stands in for the three (``--configs ...,adaptive@stall`` adds stall's). No one placement
  rule wins under both kinds of SLO (a mean-ITL one rewards prefilling on any free core, a max-gap
  one keeping prompts off D), so the user says which one the deployment serves. The declaring
  variants take the budget adaptive's tuning chose. About 90-105 min on 2 cores in all.
"""

from __future__ import annotations

import dataclasses

from pdserve.bench.plan import BenchPlan, Workload
from pdserve.errors import ConfigError
from pdserve.slo import SLO

DEFAULT_SLOS = ("blog:ttft<1000,mean_itl<50", "tight:ttft<500,mean_itl<40", "stall:ttft<500,max_gap<100",
                "stall1s:ttft<1000,max_gap<100", "gap50:ttft<1000,max_gap<50")

# configurations that need a launcher mode which may not be registered yet: dropped from a
# preset (with a note) where it is missing, an error where asked for by --configs
OPTIONAL_CONFIGS = ("adaptive",)

PRESETS: dict[str, BenchPlan] = {
    "default": BenchPlan(
        # --configs ...,read adds read (tuned alike); adaptive@NAME declares SLO NAME (slo_targets.py):
        # adaptive's own bounds are gap50's, stricter than stall's and stall1s's (adaptive@stall adds them)
        configs=("collocated", "round-robin", "write", "adaptive", "adaptive@blog", "adaptive@tight"),
        rates=(),
        rate_fractions=(0.2, 0.3, 0.45, 0.65, 0.9),
        seeds=(1, 2, 3),
        workload=Workload(input_len=512, output_len=64, num_prompts=30),
        slos=tuple(SLO.parse(s) for s in DEFAULT_SLOS),
        model="small",
        headline_rate=0.3,
        candidates=(("collocated", ("default", "256")), ("round-robin", ("default", "256")),
                    ("write", ("default", "512")), ("read", ("default", "512")),
                    ("adaptive", ("512", "512+serve"))),  # D's chunk follows its streams (chunk_size.py)
        interleave=True,  # seed by seed: drift between deployments shifts every configuration alike
    ),
    # The product in a few minutes on the tiny model: PD (write, adaptive) against plain serving.
    "quick": BenchPlan(
        configs=("collocated", "write", "adaptive"),  # collocated's points run on the calibration deployment
        rates=(),
        rate_fractions=(0.5, 1.2),
        seeds=(1, 2),
        workload=Workload(input_len=256, output_len=32, num_prompts=20),
        slos=tuple(SLO.parse(s) for s in DEFAULT_SLOS),
        model="tiny",
        headline_rate=1.2,  # the upper rate
        warmup_prompts=2,
    ),
}

WORKLOADS: dict[str, dict] = {
    "random": {},  # the preset's own lengths
    "decode-heavy": dict(input_len=128, output_len=512),
    "shared-prefix": dict(kind="shared-prefix", prefix_len=384, num_prefixes=4),  # 3/4 of a 512-token prompt
    "multi-turn": dict(kind="multi-turn", turns=3, input_len=128),  # 3 chat turns, ~128 new tokens each
}

RATIONALE = {
    "default": (
        "Why these defaults: model `small` (~107 M parameters), where one prefill costs many decode steps so "
        "prefill/decode interference shows; ISL 512 / OSL 64; rates placed as fractions of the capacity a "
        "calibration measured on this machine; 3 arrival seeds, the same request streams for every configuration; "
        "every configuration tuned over its token budgets (vLLM's default included) by the same procedure on the "
        "same tuning stream; adaptive also told the mean-ITL SLOs it serves (adaptive@blog, adaptive@tight; adaptive's "
        "own bounds are gap50's, stricter than the stall SLOs'); configurations interleaved seed by seed; 30 requests "
        "per point, steady window scored; about 90-105 min on 2 cores."),
    "quick": ("Quick preset: the product in a few minutes on the tiny model (PD write and adaptive against plain "
              "serving); its numbers mean little."),
}


def preset(name: str) -> BenchPlan:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown bench preset {name!r} (known: {', '.join(PRESETS)})") from None


def with_workload(plan: BenchPlan, name: str) -> BenchPlan:
    """``plan`` with the named workload's lengths and kind (its prompt count and burstiness kept)."""
    try:
        fields = WORKLOADS[name]
    except KeyError:
        raise ConfigError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})") from None
    if fields.get("kind") == "shared-prefix" and plan.workload.input_len <= fields["prefix_len"]:
        fields = {**fields, "prefix_len": plan.workload.input_len * 3 // 4 // 16 * 16}
    return dataclasses.replace(plan, workload=dataclasses.replace(plan.workload, **fields))
