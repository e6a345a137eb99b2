"""docs/grafana/pdserve.json queries only series that exist: pdserve's as PDPromMetrics exposes
them, vLLM's as the installed vLLM's metrics logger defines them."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import types
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.connector.stats import PDPromMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "pdserve.json"
SERIES = re.compile(r"\b(?:pdserve|vllm):[A-Za-z0-9_:]+")
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # a collapsed row keeps its panels inside
    return out


def queried_series(dashboard: dict) -> set[str]:
    """Every pdserve:/vllm: series name a panel's query or a template variable reads."""
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return {name for expr in exprs for name in SERIES.findall(expr)}


def pdserve_series() -> set[str]:
    registry = CollectorRegistry()
    metric_types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    PDPromMetrics(types.SimpleNamespace(kv_transfer_config=None), metric_types, ["model_name", "engine"],
                  {0: ["m", "0"]})
    return {sample.name for metric in registry.collect() for sample in metric.samples}


def vllm_series() -> set[str]:
    """The series of every metric vLLM's Prometheus logger creates, read from its source."""
    source = Path(importlib.util.find_spec("vllm.v1.metrics.loggers").origin).read_text()
    defined = re.findall(r"self\._(counter|gauge|histogram)_cls\(\s*name=\"(vllm:[A-Za-z0-9_:]+)\"", source)
    assert len(defined) > 30, "vLLM's metrics logger changed shape; update this parser"
    return {name + suffix for kind, name in defined for suffix in SUFFIXES[kind]}


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_every_queried_series_exists():
    series = queried_series(load())
    known = pdserve_series() | vllm_series()
    assert not series - known, f"the dashboard queries series nobody exports: {sorted(series - known)}"
    for name in ("pdserve:kv_transfer_duration_seconds_bucket", "pdserve:kv_transfer_size_bytes_bucket",
                 "pdserve:kv_handshake_duration_seconds_bucket", "pdserve:kv_transfers_completed_total",
                 "pdserve:kv_transfers_failed_total", "pdserve:kv_transfers_fenced_total",
                 "pdserve:kv_recomputed_total", "pdserve:kv_transfer_bytes_total",
                 "pdserve:control_messages_rejected_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:kv_cache_usage_perc"):
        assert name in series, f"no panel shows {name}"


def test_every_panel_queries_through_the_datasource_variable():
    dashboard = load()
    [variable] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["query"] == "prometheus"
    graphs = [p for p in panels(dashboard) if p["type"] != "row"]
    assert graphs
    for panel in graphs:
        assert panel["datasource"]["uid"] == f"${{{variable['name']}}}", panel["title"]
        assert panel["targets"] and all(SERIES.search(t["expr"]) for t in panel["targets"]), panel["title"]


def test_latency_panels_take_quantiles_of_the_histograms():
    exprs = [t["expr"] for p in panels(load()) for t in p.get("targets", [])]
    for histogram in ("pdserve:kv_transfer_duration_seconds", "vllm:time_to_first_token_seconds",
                      "vllm:inter_token_latency_seconds"):
        quantiles = {float(m.group(1)) for e in exprs if f"{histogram}_bucket" in e
                     for m in [re.match(r"histogram_quantile\(([0-9.]+),", e)] if m}
        assert quantiles == {0.5, 0.9, 0.99}, histogram


def test_panel_ids_are_unique_and_panels_do_not_overlap():
    all_panels = panels(load())
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids))
    taken: set[tuple[int, int]] = set()
    for panel in all_panels:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
