"""The Grafana dashboard and Prometheus config in docker/: every metric a panel queries is one the
stages export, every stage is scraped, and compose provisions both."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import generate_latest

from kvledger.core.settings import NatsSettings
from kvledger.decide.metrics import DecideMetrics
from kvledger.ingest.metrics import IngestMetrics
from kvledger.ingest.publisher import JetStreamPublisher
from kvledger.store.projector import StoreMetrics

DOCKER = Path(__file__).resolve().parent.parent / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "kvledger.json"
_SAMPLE_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def exported_samples() -> set[str]:
    """Every sample name the three stages' registries can expose (a labelled family with no
    children yet still names itself in its TYPE line)."""
    names = set()
    ingest = IngestMetrics()
    ingest.publisher = JetStreamPublisher(NatsSettings(), [])  # its families appear once ingest publishes
    for registry in (ingest.registry, StoreMetrics().registry, DecideMetrics().registry):
        for line in generate_latest(registry).decode().splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ", 3)
                names.add(name)
                names.update(name + suffix for suffix in {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(kind, ()))
            elif line and not line.startswith("#"):
                names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def panel_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_every_metric_a_panel_queries_is_exported() -> None:
    exported = exported_samples()
    queried = {name for expr in panel_queries() for name in re.findall(r"\bkvledger_[a-z_]+", expr)}
    assert queried, "the dashboard queries no kvledger metric"
    assert sorted(queried - exported) == []


def test_the_dashboard_covers_each_stage_s_throughput_lag_errors_and_decision_latency() -> None:
    queries = " ".join(panel_queries())
    for needed in ("kvledger_ingest_batches_out", "kvledger_store_messages", "kvledger_decide_decisions",  # throughput
                   "kvledger_ingest_engine_to_ack_seconds", "kvledger_store_pending_messages", "kvledger_decide_inventory_lag",  # lag
                   "kvledger_store_database_errors", "kvledger_decide_malformed_requests", "kvledger_ingest_rejected_events",  # errors
                   "kvledger_ingest_dead_letters", "kvledger_store_dead_letters", "kvledger_store_uncertain_workers",
                   "kvledger_decide_latency_seconds_bucket"):
        assert needed in queries, needed
    assert "by (le, backend)" in queries  # decision latency per backend


def test_prometheus_scrapes_every_stage_and_compose_provisions_grafana() -> None:
    scrape = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = {target for job in scrape["scrape_configs"] for group in job["static_configs"] for target in group["targets"]}
    assert targets == {"ingest:9101", "store:9102", "decide:9103"}
    services = yaml.safe_load((DOCKER / "compose.yml").read_text())["services"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    grafana_volumes = services["grafana"]["volumes"]
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana_volumes
    provider = yaml.safe_load((DOCKER / "grafana" / "provisioning" / "dashboards" / "kvledger.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    datasource = yaml.safe_load((DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    uids = {target["datasource"]["uid"] for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel.get("targets", [])}
    assert uids == {datasource["datasources"][0]["uid"]}


def test_label_values_known_up_front_show_at_zero_before_their_first_event() -> None:
    """rate() misses a series that appears with its first increment: the first dead letter, gap,
    rewind or refused request must find its series already there, at 0."""
    from kvledger.core.decision_codec import REQUEST_FIELDS
    from kvledger.core.settings import Settings
    from kvledger.store.service import StoreService

    settings = Settings()
    store = StoreService(settings).metrics.text().decode()
    for stream in ("KV_EVENTS", "KV_DECISIONS", "KV_DEAD_LETTERS"):
        for family in ("kvledger_store_dead_letters_total", "kvledger_store_consumer_rewinds_total",
                       "kvledger_store_stream_losses_total"):
            assert f'{family}{{stream="{stream}"}} 0.0' in store, (family, stream)
    decide = DecideMetrics()
    decide.expect("field", REQUEST_FIELDS)
    assert 'kvledger_decide_malformed_requests_total{field="token_ids"} 0.0' in decide.text().decode()
