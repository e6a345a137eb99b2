"""What a benchmark run measures, frozen once and stored next to its results.

A results directory holds exactly one plan (``plan.json``); resuming into a directory whose plan
differs is refused, so points measured under different settings are never mixed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.budget import ADAPTIVE_CONFIGS, SLO_SEPARATOR, TWO_HOST_CONFIGS, Budget, base_config, declared_slo
from pdserve.errors import ConfigError
from pdserve.slo import SLO

KNOWN_CONFIGS = ("collocated", "round-robin", "chunked", "write", "read", "nixl", *ADAPTIVE_CONFIGS, *TWO_HOST_CONFIGS)


WORKLOAD_KINDS = ("random", "shared-prefix", "multi-turn")
PROMPT_CHUNK_TOKENS = 16  # prompts are built from chunks of this many tokens (see trace.py)


@dataclass(frozen=True)
class Workload:
    """The requests of one point (one rate, one seed): random-token prompts of ``input_len``
    tokens, each generating exactly ``output_len`` tokens (--ignore-eos).

    ``shared-prefix``: every prompt starts with one of ``num_prefixes`` shared prefixes of
    ``prefix_len`` tokens (chosen at random per request); the rest of the prompt is its own.
    ``multi-turn``: ``num_prompts`` conversations of ``turns`` chat turns (conversation.py), each
    turn adding a user message of about ``input_len`` tokens to the previous turns and answers."""

    input_len: int
    output_len: int
    num_prompts: int
    burstiness: float = 1.0  # 1 = Poisson arrivals
    kind: str = "random"
    prefix_len: int = 0
    num_prefixes: int = 0
    turns: int = 1

    def __post_init__(self) -> None:
        if min(self.input_len, self.output_len, self.num_prompts) < 1 or self.burstiness <= 0:
            raise ConfigError(f"workload lengths, prompt count and burstiness must be positive: {self}")
        if self.kind not in WORKLOAD_KINDS:
            raise ConfigError(f"unknown workload kind {self.kind!r} (known: {', '.join(WORKLOAD_KINDS)})")
        if self.kind == "shared-prefix" and not (
                self.num_prefixes >= 1 and 0 < self.prefix_len < self.input_len
                and self.prefix_len % PROMPT_CHUNK_TOKENS == 0):
            raise ConfigError(f"a shared-prefix workload needs num_prefixes >= 1 and a prefix_len below input_len "
                              f"in multiples of {PROMPT_CHUNK_TOKENS}: {self}")
        if (self.kind == "multi-turn") != (self.turns > 1) or self.turns < 1:
            raise ConfigError(f"a multi-turn workload (and only one) has turns >= 2: {self}")

    @property
    def prefix_caching(self) -> bool:
        """Whether deployments serving it keep prefix caching on (only where prompts share prefixes)."""
        return self.kind in ("shared-prefix", "multi-turn")

    @property
    def num_requests(self) -> int:
        """Requests per point (conversations x turns for multi-turn)."""
        return self.num_prompts * self.turns


@dataclass(frozen=True)
class Point:
    """One bench invocation: a configuration at a rate with an arrival seed.

    The seed alone fixes the request stream (arrivals.py, trace.py): the same prompts and the
    same unit-rate arrival pattern at every rate and in every configuration."""

    config: str
    rate: float
    seed: int

    @property
    def key(self) -> str:
        return f"{self.config}/r{self.rate:g}_s{self.seed}"


@dataclass(frozen=True)
class BenchPlan:
    """What to measure. Rates are either absolute (``rates``, req/s) or, in the presets,
    ``rate_fractions`` of the capacity that a calibration measures at the start of the run
    (calibrate.py); ``resolved`` turns the second into the first, and ``headline_rate`` is then a
    fraction too. ``candidates`` lists, per configuration, the budgets to tune over (budget.py);
    a configuration without any runs with vLLM's defaults (``chunked``: ``chunked_tokens``)."""

    configs: tuple[str, ...]
    rates: tuple[float, ...]
    seeds: tuple[int, ...]
    workload: Workload
    slos: tuple[SLO, ...]
    model: str  # model size name (pdserve make-model) or a model directory
    headline_rate: float  # the rate of the Table-3 style comparison (a fraction with rate_fractions)
    target: float = 0.9  # attainment needed for a rate to count towards goodput
    chunked_tokens: int = 256  # --max-num-batched-tokens of `chunked` when it is not tuned
    candidates: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (config, budget specs) to tune over
    warmup_prompts: int = 4
    rate_fractions: tuple[float, ...] = ()
    warmup_fraction: float = 0.2  # of the arrival span, not scored (the system fills up)
    cooldown_fraction: float = 0.1  # of the arrival span, not scored (arrivals stop, the system drains)
    tune_slo: str = ""  # the SLO whose attainment tuning maximises (default: the first)
    interleave: bool = False  # configurations take turns seed by seed (rounds()) instead of one after another
    legacy: bool = False  # read from a plan of the first bench version (vLLM's random dataset, one stream per rate)

    def __post_init__(self) -> None:
        unknown = [c for c in self.configs if base_config(c) not in KNOWN_CONFIGS]
        if unknown:
            raise ConfigError(f"unknown configurations {unknown} (known: {', '.join(KNOWN_CONFIGS)}, "
                              f"and adaptive{SLO_SEPARATOR}SLO_NAME)")
        self._check_declared_slos()
        if not self.configs or not (self.rates or self.rate_fractions) or not self.seeds or not self.slos:
            raise ConfigError("a plan needs at least one configuration, rate, seed and SLO")
        if self.rates and self.rate_fractions:
            raise ConfigError("give rates or rate fractions of the calibrated capacity, not both")
        grid = self.rates or self.rate_fractions
        if len(set(self.configs)) != len(self.configs) or len(set(grid)) != len(grid):
            raise ConfigError("configurations and rates must not repeat")
        if any(r <= 0 for r in grid):
            raise ConfigError(f"rates must be positive: {grid}")
        if not 0 < self.target <= 1:
            raise ConfigError(f"attainment target must be in (0, 1]: {self.target}")
        if not (0 <= self.warmup_fraction and 0 <= self.cooldown_fraction
                and self.warmup_fraction + self.cooldown_fraction < 0.9):
            raise ConfigError(f"warm-up {self.warmup_fraction} + cool-down {self.cooldown_fraction} leave no window")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"seeds must not repeat: {self.seeds}")
        if self.tune_slo and self.tune_slo not in [s.name for s in self.slos]:
            raise ConfigError(f"tune SLO {self.tune_slo!r} is none of the plan's SLOs")
        for config, specs in self.candidates:
            if base_config(config) not in KNOWN_CONFIGS or not specs:
                raise ConfigError(f"tuning candidates for {config!r}: unknown configuration or no candidate")
            for spec in specs:
                Budget.parse(spec).check(config)

    def _check_declared_slos(self) -> None:
        names = [s.name for s in self.slos]
        for config in self.configs:
            name = declared_slo(config)
            if name is None:
                continue
            if base_config(config) not in ADAPTIVE_CONFIGS:
                raise ConfigError(f"{config}: only adaptive placement declares an SLO")
            if name not in names:
                raise ConfigError(f"{config}: {name!r} is none of the plan's SLOs ({', '.join(names)})")

    def declared_slo(self, config: str) -> SLO | None:
        """The plan's SLO that ``config`` (``adaptive@NAME``) declares to its deployment, if any."""
        name = declared_slo(config)
        return next((s for s in self.slos if s.name == name), None) if name is not None else None

    @property
    def calibrated(self) -> bool:
        """Whether the rates still have to be placed by a calibration (``resolved``)."""
        return bool(self.rate_fractions)

    def resolved(self, capacity: float) -> "BenchPlan":
        """The plan with ``rate_fractions`` x ``capacity`` (req/s, 2 decimals) as its rates."""
        if not self.rate_fractions:
            return self
        rates = tuple(sorted({round(f * capacity, 2) for f in self.rate_fractions}))
        if len(rates) != len(self.rate_fractions) or rates[0] <= 0:
            raise ConfigError(f"capacity {capacity:.3f} req/s is too small for the rate grid {self.rate_fractions}")
        return dataclasses.replace(self, rates=rates, rate_fractions=(),
                                   headline_rate=round(self.headline_rate * capacity, 2))

    def budgets(self, config: str) -> tuple[Budget, ...]:
        """The tuning candidates of ``config`` (``adaptive@NAME``: its own, else adaptive's); empty
        when it is not tuned."""
        return self.own_budgets(config) or self.own_budgets(base_config(config))

    def own_budgets(self, config: str) -> tuple[Budget, ...]:
        """The tuning candidates given for ``config`` by its own name (``--tune adaptive@tight=...``)."""
        specs = next((specs for c, specs in self.candidates if c == config), ())
        return tuple(Budget.parse(s) for s in specs)

    @property
    def tuning_slo(self) -> SLO:
        return next((s for s in self.slos if s.name == self.tune_slo), self.slos[0])

    def points(self) -> list[Point]:
        """Every point, grouped by configuration (one deployment each), rates ascending."""
        return [Point(c, r, s) for c in self.configs for r in sorted(self.rates) for s in self.seeds]

    def rounds(self) -> list[tuple[str, tuple[int, ...]]]:
        """The deployments of a sweep, in order: (configuration, the seeds whose points it runs).

        One after another, each configuration runs all its points in one deployment. Interleaved,
        each seed is a round in which every configuration runs that seed's points in a deployment of
        its own, the order rotating by one from round to round: a machine that drifts over the run
        (on these shared machines the same configuration's ITL moved ~10 ms between deployments
        minutes apart) then shifts every configuration alike instead of whichever ran last, at the
        cost of one deployment per configuration and seed."""
        if not self.interleave:
            return [(c, self.seeds) for c in self.configs]
        n = len(self.configs)
        return [(self.configs[(i + k) % n], (seed,)) for i, seed in enumerate(self.seeds) for k in range(n)]

    @property
    def headline(self) -> float:
        """The measured rate used for the headline table: the highest rate <= headline_rate."""
        below = [r for r in self.rates if r <= self.headline_rate]
        return max(below) if below else min(self.rates)

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["slos"] = [str(s) for s in self.slos]
        data["candidates"] = {c: list(specs) for c, specs in self.candidates}
        return data

    @classmethod
    def from_json(cls, data: dict) -> "BenchPlan":
        fields = dict(data)
        fields["workload"] = Workload(**fields["workload"])
        fields["slos"] = tuple(SLO.parse(s) for s in fields["slos"])
        fields["candidates"] = tuple((c, tuple(specs)) for c, specs in fields.get("candidates", {}).items())
        if "chunk_candidates" in fields:  # a plan written before CRN streams and steady windows: score everything
            fields.pop("chunk_candidates")
            fields["legacy"] = True
            fields.setdefault("warmup_fraction", 0.0)
            fields.setdefault("cooldown_fraction", 0.0)
        for key in ("configs", "rates", "seeds", "rate_fractions"):
            fields[key] = tuple(fields.get(key, ()))
        return cls(**fields)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "BenchPlan":
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"cannot read bench plan {path}: {exc}") from exc
