"""Per-role token budgets (vLLM --max-num-batched-tokens) of one deployment, as tuning candidates.

Written ``default`` (vLLM's own, 2048 on CPU), ``256`` (every instance; for PD modes the prefill
instance) or ``512/256`` (prefill instance / decode instance, PD modes only; with adaptive placement
the decode budget is the chunk in which decode prefills a prompt itself). ``+serve`` after an
adaptive budget (``512/64+serve``) also lets the prefill instance serve whole requests
(``pdserve up --prefill-serves-decode``), so tuning decides whether that helps the workload.
``write-two-host`` and ``read-two-host`` are write and read with P and D in two network
namespaces: budgeted the same way. ``adaptive@NAME`` is adaptive declaring the plan's SLO ``NAME``
(``pdserve up --slo``): budgeted, and tuned, as adaptive. ``adaptive-read`` is adaptive placement
in READ mode, budgeted the same way (``adaptive-read@NAME`` declares an SLO too); ``+serve`` is
WRITE-only.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.errors import ConfigError

SERVE_SUFFIX = "+serve"
PLAIN_CONFIGS = ("collocated", "round-robin", "chunked")  # every instance prefills and decodes
TWO_HOST_SUFFIX = "-two-host"
TWO_HOST_CONFIGS = ("write" + TWO_HOST_SUFFIX, "read" + TWO_HOST_SUFFIX)  # P and D in two network namespaces
# adaptive placement, and the static disaggregation each is also compared with (report.py)
STATIC_OF_ADAPTIVE = {"adaptive": "write", "adaptive-read": "read"}
ADAPTIVE_CONFIGS = tuple(STATIC_OF_ADAPTIVE)
SLO_SEPARATOR = "@"  # adaptive@tight: adaptive placement declaring the plan's SLO `tight`


def base_config(config: str) -> str:
    """The configuration a name deploys: ``adaptive@tight`` is adaptive."""
    return config.partition(SLO_SEPARATOR)[0]


def declared_slo(config: str) -> str | None:
    """The name of the SLO a configuration declares (``adaptive@tight``: ``tight``), if any."""
    base, sep, name = config.partition(SLO_SEPARATOR)
    return name if sep else None


@dataclass(frozen=True)
class Budget:
    prefill: int | None = None  # plain configurations: every instance
    decode: int | None = None
    serve_decode: bool = False  # adaptive: the prefill instance serves whole requests too

    @classmethod
    def parse(cls, spec: str) -> "Budget":
        text, *flags = spec.strip().split("+")
        flags = ["+" + f.strip() for f in flags]
        parts = [p.strip() for p in text.split("/")]
        if len(parts) > 2 or not all(parts) or not set(flags) <= {SERVE_SUFFIX} or len(flags) > 1:
            raise ConfigError(f"budget {spec!r} is not default, TOKENS or PREFILL/DECODE (e.g. 512/256), "
                              f"optionally followed by {SERVE_SUFFIX}")
        values = [None if p == "default" else _tokens(p, spec) for p in parts]
        return cls(values[0], values[1] if len(values) == 2 else None, SERVE_SUFFIX in flags)

    def check(self, config: str) -> None:
        config = base_config(config)
        if config in PLAIN_CONFIGS and self.decode is not None:
            raise ConfigError(f"{config} has no decode instance: budget {self} names one")
        if self.serve_decode and config != "adaptive":
            raise ConfigError(f"budget {self}: only adaptive's prefill instance can serve whole requests ({config})")

    def __str__(self) -> str:
        text = "default" if self.prefill is None else str(self.prefill)
        text = text if self.decode is None else f"{text}/{self.decode}"
        return text + (SERVE_SUFFIX if self.serve_decode else "")


def _tokens(text: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"budget {spec!r}: {text!r} is not a token count") from None
    if not 16 <= value <= 1 << 20:
        raise ConfigError(f"budget {spec!r}: {value} is not a token count in 16..{1 << 20}")
    return value
