"""deploy/prometheus/alerts.yml and deploy/grafana/agentroster-dashboard.json against the exporter.

promtool is not on PyPI, so the rules are checked here: their structure, their
PromQL parsed by `promql-parser` (a PyPI package binding the Rust parser
Prometheus-compatible databases use; with a fallback that only extracts names),
and every metric they name must be one the worker's exporter produces. The
Temporal SDK's `temporal_*` names used by the dashboard are checked against a
real scrape in tests/test_metrics.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import agentroster.vocabulary.metrics  # noqa: F401  (registers this process's metrics)
from agentroster.models import AgentState, CapabilityStatus, PoolAgentRow, PoolPolicy, PoolStatus
from agentroster.ops.metrics_exporter import pool_families

REPO = Path(__file__).resolve().parents[1]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "agentroster-dashboard.json"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"), "summary": ("", "_sum", "_count", "_created")}
# Grafana's variables, replaced by plain values before parsing.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "1m", "$pool": "p", "$capability": "c"}
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_DURATION = re.compile(r"(\d+(ms|s|m|h|d|w|y))+")


def exported_names() -> set[str]:
    """Every sample name the worker's /metrics can carry, SDK metrics aside."""
    status = PoolStatus(
        pool="p",
        agents=[PoolAgentRow(agent_id="a", deployment="d", state=AgentState.READY, in_flight=1, capabilities=["c@1.0.0"], uses=3, retiring="worn", health_failures=1)],
        capabilities={"c": CapabilityStatus(agents={"Ready": 1}, slots=2, idle_slots=1, in_flight=1, counters={"granted": 3})},
        policies={"d": PoolPolicy()},
        breakers={"c": "open"},
        leases_granted=4,
    )
    text = generate_latest(REGISTRY).decode()
    families = list(text_string_to_metric_families(text))
    names: set[str] = set()
    for family in [*families, *pool_families({"p": status}, per_agent=True)]:
        for suffix in SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (every selector must name one)."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    try:
        import promql_parser
    except ImportError:  # the names only: strings, label matchers and functions removed
        bare = re.sub(r'"[^"]*"', "", expr)
        bare = re.sub(r"\{[^}]*\}", "", bare)
        bare = re.sub(r"\[[^\]]*\]", "", bare)
        bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
        return {n for n in _NAME.findall(bare) if n.startswith(("agentroster_", "temporal_"))}
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def alert_rules() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    document = yaml.safe_load(ALERTS.read_text())
    return [(group, rule) for group in document["groups"] for rule in group["rules"]]


def seconds(duration: str) -> float:
    assert _DURATION.fullmatch(duration), f"{duration!r} is not a Prometheus duration"
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", duration))


def test_alert_rules_are_well_formed_and_name_exported_metrics() -> None:
    exported = exported_names()
    rules = alert_rules()
    assert rules
    names = [rule["alert"] for _, rule in rules]
    assert len(names) == len(set(names)), "alert names repeat"
    for group, rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rule["alert"])
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        if "for" in rule:
            seconds(rule["for"])
        if "interval" in group:
            seconds(group["interval"])
        used = metric_names(rule["expr"])
        assert used, rule["alert"]
        assert used <= exported, f"{rule['alert']}: {sorted(used - exported)} not exported"


def test_the_alerts_the_issue_asks_for_are_there() -> None:
    by_name = {rule["alert"]: (group, rule) for group, rule in alert_rules()}
    # The reference: waiters > 0 for more than 10 s, evaluated often enough to see 10 s.
    group, waiting = by_name["AgentrosterCallersWaiting"]
    assert metric_names(waiting["expr"]) == {"agentroster_waiters"} and re.search(r">\s*0\b", waiting["expr"])
    assert seconds(waiting["for"]) == 10 and seconds(group["interval"]) < 10
    exprs = {name: rule["expr"] for name, (_, rule) in by_name.items()}
    assert "agentroster_pool_exhausted_total" in metric_names(exprs["AgentrosterPoolExhausted"])
    assert 'cause="lost"' in exprs["AgentrosterAgentLost"]
    assert 'state="open"' in exprs["AgentrosterBreakerOpen"]
    assert metric_names(exprs["AgentrosterSelfPreservation"]) == {"agentroster_pool_self_preservation"}


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        text = query.get("query") if isinstance(query, dict) else None
        if text and (m := re.fullmatch(r"label_values\((.+),\s*\w+\)", text)):
            exprs.append(m.group(1))
    return exprs


def dashboard_names() -> set[str]:
    return {name for expr in dashboard_exprs() for name in metric_names(expr)}


def test_the_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["expr"].strip() and target["refId"]
    used = dashboard_names()
    ours = {n for n in used if n.startswith("agentroster_")}
    assert used - ours <= {n for n in used if n.startswith("temporal_")}, "a metric that is neither ours nor the SDK's"
    assert ours <= exported_names(), sorted(ours - exported_names())
    # The panels an operator needs first are there.
    for needed in ("agentroster_waiters", "agentroster_utilization_ratio", "agentroster_acquire_wait_seconds_bucket",
                   "agentroster_pool_exhausted_total", "agentroster_breaker_state", "agentroster_pool_self_preservation"):
        assert needed in ours


def test_the_name_check_itself() -> None:
    names = exported_names()
    # Counters' samples carry _total, histograms' _bucket: the names PromQL uses.
    assert {"agentroster_leases_granted_total", "agentroster_scale_requests_total", "agentroster_acquire_wait_seconds_bucket"} <= names
    assert not metric_names("rate(agentroster_nope_total[5m]) > 0") <= names
    assert metric_names('histogram_quantile(0.9, sum by (le) (rate(agentroster_acquire_wait_seconds_bucket{pool=~"$pool"}[$__rate_interval])))') == {
        "agentroster_acquire_wait_seconds_bucket"
    }
