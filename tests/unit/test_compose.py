"""compose.yaml and deploy/: valid against the Compose Specification, and consistent with the code.

No Docker engine is needed: the file is checked against the Compose Specification's JSON Schema, vendored in
tests/data/ (see tests/data/README.md for where it came from), and against topics/settings.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import jsonschema
import pytest
import yaml

from streams.runtime.metrics import METRIC_FAMILIES
from tests.paths import REPO_ROOT
from topics.settings import Settings

COMPOSE = REPO_ROOT / "compose.yaml"
SCHEMA = REPO_ROOT / "tests" / "data" / "compose-spec.json"
PROMETHEUS = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = REPO_ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "treadle.json"

# The worker's Prometheus metrics, name -> type: the dashboard must show each and nothing else.
METRICS = METRIC_FAMILIES
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
KAFKA_SERVICES = ("kafka-1", "kafka-2", "kafka-3")
TREADLE_SERVICES = ("init", "sink", "worker")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def _settings_variables() -> set[str]:
    return {field.description.split(":", 1)[0] for field in Settings.model_fields.values()}


# --- the Compose Specification -------------------------------------------------------------------------------


def test_compose_file_is_valid_against_the_compose_specification(compose: dict[str, Any]) -> None:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_the_schema_check_catches_a_broken_file(compose: dict[str, Any]) -> None:
    """Guards against a schema that accepts anything: a misspelt key and a bad condition must fail."""
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    broken = json.loads(json.dumps(compose))
    broken["services"]["worker"]["depends_on"]["init"]["condition"] = "service_done"
    broken["services"]["sink"]["healthchek"] = {}
    assert len(list(validator.iter_errors(broken))) >= 2


def test_depends_on_points_at_services_with_what_the_condition_needs(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for target, spec in service.get("depends_on", {}).items():
            assert target in services, f"{name} depends on unknown service {target}"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target} to be healthy; it has no check"
            if spec["condition"] == "service_completed_successfully":
                assert services[target].get("restart", "no") == "no", f"{target} must run once to complete"


def test_every_bind_mount_and_build_file_exists(services: dict[str, dict[str, Any]]) -> None:
    checked = 0
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.get("source") if isinstance(volume, dict) else volume.split(":", 1)[0]
            if isinstance(volume, dict) and volume.get("type") != "bind":
                continue
            if not source.startswith((".", "/")):
                continue  # a named volume
            assert (REPO_ROOT / source).resolve().exists(), f"{name} mounts {source}, which is not in the repository"
            checked += 1
        build = service.get("build")
        if build:
            context = REPO_ROOT / build["context"]
            dockerfile = context / build["dockerfile"]
            assert dockerfile.is_file(), f"{name} builds from missing {dockerfile}"
            text = dockerfile.read_text()
            stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, flags=re.MULTILINE))
            for line in text.splitlines():
                if line.startswith("COPY --from="):  # from an earlier build stage, not the context
                    stage = line.split()[1].removeprefix("--from=")
                    assert stage in stages, f"{dockerfile.name} copies from unknown stage {stage}"
                elif line.startswith("COPY "):
                    for source in line.split()[1:-1]:
                        assert (context / source).exists(), f"{dockerfile.name} copies missing {source}"
    assert checked >= 3


# --- the cluster shape ---------------------------------------------------------------------------------------


def test_kafka_is_a_three_broker_kraft_quorum_with_replicated_internal_topics(
    services: dict[str, dict[str, Any]],
) -> None:
    node_ids = set()
    for name in KAFKA_SERVICES:
        service = services[name]
        env = _env(service)
        assert service["image"] == "apache/kafka:4.1.1"
        assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
        voters = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")
        assert sorted(voters) == [f"{i}@kafka-{i}:9093" for i in (1, 2, 3)]
        assert f"PLAINTEXT://{name}:9092" in env["KAFKA_ADVERTISED_LISTENERS"]
        assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "3"
        assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "3"
        assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "2"
        assert env["KAFKA_MIN_INSYNC_REPLICAS"] == "2"
        assert "healthcheck" in service
        node_ids.add(env["KAFKA_NODE_ID"])
    assert node_ids == {"1", "2", "3"}
    assert len({_env(services[name])["CLUSTER_ID"] for name in KAFKA_SERVICES}) == 1


def test_treadle_services_use_real_settings_and_the_cluster(services: dict[str, dict[str, Any]]) -> None:
    known = _settings_variables()
    for name in TREADLE_SERVICES:
        env = _env(services[name])
        assert set(env) <= known, f"{name} sets variables topics/settings.py does not read: {set(env) - known}"
        settings = Settings.from_env(env)  # the values parse
        assert settings.replication_factor == 3
        assert not settings.local_kafka
        assert settings.clickhouse_url and settings.redis_url
        assert sorted(settings.kafka_bootstrap_servers.split(",")) == [f"{k}:9092" for k in KAFKA_SERVICES]


def test_the_sink_runs_as_its_own_service_and_the_worker_does_not_start_one(
    services: dict[str, dict[str, Any]],
) -> None:
    assert services["sink"]["command"] == ["treadle", "sink"]
    assert services["worker"]["command"] == ["treadle", "worker"]
    assert Settings.from_env(_env(services["worker"])).sink == "off"
    assert "treadle up" in " ".join(services["init"]["command"])  # topics and schemas
    assert "apply_migrations" in " ".join(services["init"]["command"])
    for name in ("sink", "worker"):
        assert services[name]["depends_on"]["init"]["condition"] == "service_completed_successfully"


def test_healthchecks_probe_the_configured_ports(services: dict[str, dict[str, Any]]) -> None:
    sink = Settings.from_env(_env(services["sink"]))
    worker = Settings.from_env(_env(services["worker"]))
    assert f":{sink.sql_port}/sql" in " ".join(services["sink"]["healthcheck"]["test"])
    assert f"{worker.web_port})" in " ".join(services["worker"]["healthcheck"]["test"])


# --- Prometheus and Grafana ----------------------------------------------------------------------------------


def _scrape_job(config: dict[str, Any], job: str) -> dict[str, Any]:
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert job in jobs, f"prometheus.yml has no {job} job"
    return jobs[job]


def test_prometheus_scrapes_every_worker_and_the_sink(services: dict[str, dict[str, Any]]) -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    for job, service, port in (("treadle-worker", "worker", "web_port"), ("treadle-sink", "sink", "sql_port")):
        scrape = _scrape_job(config, job)
        assert scrape.get("metrics_path", "/metrics") == "/metrics"
        (sd,) = scrape["dns_sd_configs"]  # one A record per replica: `--scale worker=N` needs no edit
        assert sd["names"] == [service] and sd["type"] == "A"
        settings = Settings.from_env(_env(services[service]))
        assert sd["port"] == getattr(settings, port) and settings.bind_host == "0.0.0.0"
    mounts = services["prometheus"]["volumes"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def _container_path(service: dict[str, Any], host_path: str) -> str:
    for volume in service["volumes"]:
        source, target, *_ = volume.split(":")
        if source == host_path:
            return target
    raise AssertionError(f"{host_path} is not mounted")


def test_grafana_provisions_the_datasource_and_the_dashboard(services: dict[str, dict[str, Any]]) -> None:
    grafana = services["grafana"]
    assert _container_path(grafana, "./deploy/grafana/provisioning") == "/etc/grafana/provisioning"
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (datasource,) = datasources["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "treadle.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["options"]["path"] == _container_path(grafana, "./deploy/grafana/dashboards")

    dashboard = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {datasource["uid"]}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def _expressions(dashboard: dict[str, Any]) -> list[str]:
    panels = [*dashboard["panels"], *(child for p in dashboard["panels"] for child in p.get("panels", []))]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    exprs += [str(v.get("query", "")) for v in dashboard.get("templating", {}).get("list", [])]
    return [e for e in exprs if e]


def _metric_of(series: str) -> str:
    for suffix in HISTOGRAM_SERIES:
        base = series.removesuffix(suffix)
        if base != series and METRICS.get(base) == "histogram":
            return base
    return series


def test_dashboard_uses_exactly_the_worker_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _expressions(dashboard)
    assert exprs
    used: set[str] = set()
    for expr in exprs:
        series = set(re.findall(r"\btreadle_[a-z0-9_]+", expr))
        assert series, f"not a treadle metric: {expr}"
        unknown = {s for s in series if _metric_of(s) not in METRICS}
        assert not unknown, f"{expr} uses metrics the worker does not export: {unknown}"
        for s in series:
            if METRICS[_metric_of(s)] == "histogram" and s == _metric_of(s):
                pytest.fail(f"{expr}: query a histogram through its _bucket/_sum/_count series")
        used |= {_metric_of(s) for s in series}
    assert used == set(METRICS), f"the dashboard shows none of {set(METRICS) - used}"


def test_latency_panels_show_p50_p95_p99() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _expressions(dashboard)
    for histogram in ("treadle_reward_join_latency_seconds", "treadle_sink_batch_seconds"):
        quantiles = {
            q
            for e in exprs
            for q in re.findall(rf"histogram_quantile\((0\.\d+),.*\b{histogram}_bucket\b", e)
            if "le" in e
        }
        assert quantiles == {"0.5", "0.95", "0.99"}, histogram


def test_vendored_schema_is_the_one_its_readme_names() -> None:
    notes = (SCHEMA.parent / "README.md").read_text()
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() in notes, "update tests/data/README.md with the new file"


def test_the_local_three_broker_cluster_matches_the_compose_brokers(
    services: dict[str, dict[str, Any]], tmp_path
) -> None:
    """`treadle up --brokers 3` writes the replication, in-sync and record-size limits of compose.yaml's brokers."""
    from topics.settings import KAFKA_MAX_MESSAGE_BYTES, min_insync_replicas
    from treadle.devstack.kafka import LocalKafka

    settings = Settings(home=tmp_path, kafka_brokers=3)
    assert settings.kafka_bootstrap_servers == "127.0.0.1:19092,127.0.0.1:19094,127.0.0.1:19096"
    node = LocalKafka(settings, node_id=2)
    node._write_config()
    props = dict(line.split("=", 1) for line in node.config_path.read_text().splitlines() if "=" in line)
    assert props["node.id"] == "2" and props["listeners"].startswith("PLAINTEXT://127.0.0.1:19094,")
    assert props["controller.quorum.voters"] == "1@127.0.0.1:19093,2@127.0.0.1:19095,3@127.0.0.1:19097"
    for name in KAFKA_SERVICES:
        env = _env(services[name])
        assert props["default.replication.factor"] == str(env["KAFKA_DEFAULT_REPLICATION_FACTOR"]) == "3"
        assert props["min.insync.replicas"] == str(env["KAFKA_MIN_INSYNC_REPLICAS"]) == str(min_insync_replicas(3))
        assert props["message.max.bytes"] == env["KAFKA_MESSAGE_MAX_BYTES"] == str(KAFKA_MAX_MESSAGE_BYTES)
        assert props["replica.fetch.max.bytes"] == env["KAFKA_REPLICA_FETCH_MAX_BYTES"] == str(KAFKA_MAX_MESSAGE_BYTES)
