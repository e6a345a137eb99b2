"""PlacementConfig: the placement keys of `kv_connector_extra_config`, parsed once.

`placement` picks the policy (`static`, the default, always disaggregates; `adaptive` decides per
request, policy.py). The other keys set what adaptive placement protects: D's streams' mean ITL
(`itl_target_ms`) and largest step (`max_step_ms`), or a declared SLO that sets both and a TTFT
bound (`slo`, slo_targets.py); `serve_decode` lets P serve whole requests too (serve_gate.py).
pdserve/config.py calls `parse_placement` with the rest of the connector's keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from pdserve.errors import ConfigError
from pdserve.placement.slo_targets import SLOTargets
from pdserve.slo import SLO

PLACEMENTS = ("static", "adaptive")
PLACEMENT_KEYS = ("placement", "placement_wait", "itl_target_ms", "max_step_ms", "transfer_overhead_ms",
                  "max_local_tokens", "serve_decode", "slo")
RESPONSE_SHARE = 0.15  # of the TTFT bound one local prefill step may hold back decisions and landed first tokens
DEFAULT_TTFT_MS = 1000.0  # the TTFT bound of a deployment that declares none (the blog SLO's)


@dataclass(frozen=True)
class PlacementConfig:
    policy: str = "static"
    wait_s: float = 2.0  # P: how long a prefill leg waits for D's decision before prefilling anyway
    itl_target_ms: float = 50.0  # D: its running streams' mean ITL must stay under this
    max_step_ms: float = 50.0  # D: no local chunk step may take longer while D decodes
    # D: the path around P's compute in a remote TTFT (P's wait for D's word, the KV's landing, D's
    # pick-up and first-token step); None: D measures it (remote_path.py), DEFAULT_PATH_MS until then
    transfer_overhead_ms: float | None = None
    max_local_tokens: float = float("inf")  # D: never prefill more uncached tokens than this itself
    serve_decode: bool = False  # P: also a decode instance for the router, serving whole requests (serve_gate.py)
    ttft_target_ms: float = math.inf  # D: a prompt P serves within TTFT_HEADROOM x this goes to P (declared SLO)
    slo: str | None = None  # the declared SLO these bounds were read from (slo_targets.py)

    @property
    def adaptive(self) -> bool:
        return self.policy == "adaptive"

    @property
    def response_step_s(self) -> float:
        """The longest local prefill step D runs, streams or not (chunk_size.py): RESPONSE_SHARE of
        the declared TTFT bound, or of DEFAULT_TTFT_MS without one."""
        ttft_ms = self.ttft_target_ms if math.isfinite(self.ttft_target_ms) else DEFAULT_TTFT_MS
        return RESPONSE_SHARE * ttft_ms / 1000

    @property
    def landing_step_s(self) -> float:
        """The longest local prefill step D runs while requests whose KV just landed take their
        first token in it (chunk_size.py): a stream's step, `max_step_ms`, or where no max gap is
        bounded the mean ITL target (its default without one)."""
        itl_ms = self.itl_target_ms if math.isfinite(self.itl_target_ms) else PlacementConfig.itl_target_ms
        return min(self.max_step_ms, itl_ms) / 1000

    @property
    def stream_itl_s(self) -> float:
        """The ITL by which D estimates how long a stream lives (decode_load.py): the target, or
        without one (an SLO that bounds no ITL) the default target."""
        return (self.itl_target_ms if math.isfinite(self.itl_target_ms) else PlacementConfig.itl_target_ms) / 1000


def parse_placement(extra: Mapping[str, Any]) -> PlacementConfig:
    policy = str(extra.get("placement", "static"))
    if policy not in PLACEMENTS:
        raise ConfigError(f"kv_connector_extra_config.placement must be one of {', '.join(PLACEMENTS)}, got {policy!r}")
    numbers = {}
    for key, field in (("placement_wait", "wait_s"), ("itl_target_ms", "itl_target_ms"), ("max_step_ms", "max_step_ms"),
                       ("transfer_overhead_ms", "transfer_overhead_ms"), ("max_local_tokens", "max_local_tokens")):
        if key not in extra:
            continue
        value = extra[key]
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"kv_connector_extra_config.{key} must be a number, got {value!r}")
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"kv_connector_extra_config.{key} must be a number, got {value!r}") from None
        if not 0 <= number < 1e9 or (key != "transfer_overhead_ms" and number == 0):
            raise ConfigError(f"kv_connector_extra_config.{key} out of range: {number}")
        numbers[field] = number
    serve_decode = extra.get("serve_decode", False)
    if serve_decode not in (True, False):
        raise ConfigError(f"kv_connector_extra_config.serve_decode must be true or false, got {serve_decode!r}")
    if serve_decode and policy != "adaptive":
        raise ConfigError("kv_connector_extra_config.serve_decode needs placement adaptive: the prefill leg of a "
                          "request the prefill instance serves whole must wait to be dropped")
    slo = _declared_slo(extra, policy, numbers)
    return PlacementConfig(policy, **numbers, serve_decode=bool(serve_decode), slo=slo)


def _declared_slo(extra: Mapping[str, Any], policy: str, numbers: dict) -> str | None:
    """The `slo` key, parsed into `numbers`' ITL target and step bound (slo_targets.py)."""
    if "slo" not in extra:
        return None
    text = extra["slo"]
    if not isinstance(text, str):
        raise ConfigError(f"kv_connector_extra_config.slo must be an SLO such as 'ttft<500,mean_itl<40', got {text!r}")
    if policy != "adaptive":
        raise ConfigError("kv_connector_extra_config.slo needs placement adaptive: it sets what placement protects")
    clash = [key for key in ("itl_target_ms", "max_step_ms") if key in extra]
    if clash:
        raise ConfigError(f"kv_connector_extra_config: give slo or {' and '.join(clash)}, not both "
                          f"(the SLO sets them)")
    slo = SLO.parse(text)
    targets = SLOTargets.of(slo)
    numbers.update(itl_target_ms=targets.itl_target_ms, max_step_ms=targets.max_step_ms,
                   ttft_target_ms=targets.ttft_target_ms)
    return slo.spec
