"""PlacementConfig: the placement keys parsed once, with clear errors; a declared SLO sets the bounds."""

from __future__ import annotations

import math

import pytest

from pdserve.errors import ConfigError
from pdserve.placement.config import parse_placement


def test_placement_config_is_parsed_once_with_clear_errors():
    assert parse_placement({}).policy == "static"
    cfg = parse_placement({"placement": "adaptive", "placement_wait": "0.5", "itl_target_ms": 80, "max_step_ms": 120})
    assert (cfg.adaptive, cfg.wait_s, cfg.itl_target_ms, cfg.max_step_ms) == (True, 0.5, 80.0, 120.0)
    assert parse_placement({}).max_step_ms == 50.0
    assert parse_placement({}).transfer_overhead_ms is None  # D measures the path (remote_path.py)
    assert parse_placement({"transfer_overhead_ms": 0}).transfer_overhead_ms == 0.0
    with pytest.raises(ConfigError, match="max_step_ms out of range"):
        parse_placement({"max_step_ms": -5})
    with pytest.raises(ConfigError, match="placement must be one of static, adaptive"):
        parse_placement({"placement": "smart"})
    with pytest.raises(ConfigError, match="itl_target_ms must be a number"):
        parse_placement({"itl_target_ms": "fast"})
    with pytest.raises(ConfigError, match="placement_wait out of range"):
        parse_placement({"placement_wait": 0})
    with pytest.raises(ConfigError, match="serve_decode needs placement adaptive"):
        parse_placement({"serve_decode": True})
    with pytest.raises(ConfigError, match="serve_decode must be true or false, got 'yes'"):
        parse_placement({"serve_decode": "yes"})


def test_a_declared_slo_sets_the_bounds_placement_protects():
    mean_only = parse_placement({"placement": "adaptive", "slo": "tight:ttft<500,mean_itl<40"})
    assert (mean_only.itl_target_ms, mean_only.max_step_ms, mean_only.slo) == (40.0, math.inf, "ttft<500,mean_itl<40")
    gap = parse_placement({"placement": "adaptive", "slo": "ttft<1000,max_gap<50"})
    assert (gap.itl_target_ms, gap.max_step_ms) == (50.0, 50.0)  # a mean is never above the largest gap
    both = parse_placement({"placement": "adaptive", "slo": "mean_itl<30,max_gap<100"})
    assert (both.itl_target_ms, both.max_step_ms) == (30.0, 100.0)
    ttft_only = parse_placement({"placement": "adaptive", "slo": "ttft<800"})
    assert (ttft_only.itl_target_ms, ttft_only.max_step_ms) == (math.inf, math.inf)
    assert ttft_only.stream_itl_s == 0.05 and both.stream_itl_s == 0.03  # a stream's life is still estimated
    with pytest.raises(ConfigError, match="slo needs placement adaptive"):
        parse_placement({"slo": "ttft<500"})
    with pytest.raises(ConfigError, match="give slo or max_step_ms, not both"):
        parse_placement({"placement": "adaptive", "slo": "ttft<500", "max_step_ms": 50})
    with pytest.raises(ConfigError, match="unknown SLO metric 'gap'"):
        parse_placement({"placement": "adaptive", "slo": "gap<500"})
    with pytest.raises(ConfigError, match="must be an SLO such as"):
        parse_placement({"placement": "adaptive", "slo": 500})
