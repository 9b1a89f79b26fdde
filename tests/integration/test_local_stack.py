"""The local stack against real processes: a Kafka broker from Maven jars, Valkey, chDB.

Ports 29092/29093/26379 and a tmp TREADLE_HOME keep these tests clear of a developer's broker on
19092. The Kafka jars are cached in the repo's ignored .treadle/cache, downloaded on the first run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from streams.runtime.processes import pid_alive
from tests.conftest import PORT_BASE
from tests.paths import REPO_ROOT
from topics.settings import Settings
from treadle.devstack import (
    LocalKafka,
    LocalStack,
    LocalValkey,
    StackError,
    explain_locked_path,
)

# Its own stack, apart from the session's (conftest.PORT_BASE + 92/93/379): 700 above those.
KAFKA_PORT, CONTROLLER_PORT, VALKEY_PORT = PORT_BASE + 792, PORT_BASE + 793, PORT_BASE + 779
SHARED_CACHE = REPO_ROOT / ".treadle" / "cache"
BOOTSTRAP = f"127.0.0.1:{KAFKA_PORT}"


def make_settings(home: Path, **overrides: object) -> Settings:
    """Settings for a test: the ambient environment (REDIS_URL, …) is ignored on purpose."""
    values: dict[str, object] = {
        "home": home,
        "cache": SHARED_CACHE,
        "kafka_bootstrap_servers": BOOTSTRAP,
        "kafka_controller_port": CONTROLLER_PORT,
        "valkey_port": VALKEY_PORT,
        "partitions": 1,
    }
    values.update(overrides)
    return Settings.from_env(env={}, **values)


@pytest.fixture
def own_stack(tmp_path: Path) -> Iterator[LocalStack]:
    """A stack of this test's own (conftest's session `stack` is shared and must stay up)."""
    local = LocalStack(make_settings(tmp_path / "home"))
    try:
        yield local
    finally:
        local.down()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A process that is not ours to stop."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def listen(port: int) -> socket.socket:
    """Occupy a port the way a foreign server would (SO_REUSEADDR: earlier tests leave TIME_WAITs)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


@pytest.fixture
def busy_port() -> Iterator[int]:
    with listen(KAFKA_PORT):
        yield KAFKA_PORT


async def test_stack_up_produce_restart_consume_down(own_stack: LocalStack) -> None:
    stack = own_stack
    status = stack.up()
    assert status.running and status.kafka.managed and status.valkey.managed
    kafka_pid, valkey_pid = status.kafka.pid, status.valkey.pid
    assert kafka_pid is not None and valkey_pid is not None
    assert status.kafka.log_path is not None and status.kafka.log_path.exists()
    assert "Kafka Server started" in status.kafka.log_path.read_text()

    admin = AIOKafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    await admin.start()
    try:
        await admin.create_topics([NewTopic("survives", num_partitions=1, replication_factor=1)])
        assert "survives" in await admin.list_topics()
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=BOOTSTRAP, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        await producer.send_and_wait("survives", b"hello", key=b"s1")
    finally:
        await producer.stop()
    redis.Redis(port=VALKEY_PORT).hset("state:s1", "v", "7")

    again = stack.up()  # already running: a no-op
    assert (again.kafka.pid, again.valkey.pid) == (kafka_pid, valkey_pid)
    assert stack.status().running

    down = stack.down()
    assert not down.kafka.running and not down.valkey.running
    assert not pid_alive(kafka_pid) and not pid_alive(valkey_pid)
    assert stack.kafka is not None and not stack.kafka.nodes[0].pid_file.path.exists()

    restarted = stack.up()
    assert restarted.running and restarted.kafka.pid != kafka_pid
    consumer = AIOKafkaConsumer(
        "survives", bootstrap_servers=BOOTSTRAP, auto_offset_reset="earliest", group_id="t", enable_auto_commit=False
    )
    await consumer.start()
    try:
        record = await consumer.getone()
    finally:
        await consumer.stop()
    assert (record.key, record.value) == (b"s1", b"hello")
    assert redis.Redis(port=VALKEY_PORT).hget("state:s1", "v") == b"7"


def test_kafka_port_in_use_is_a_clear_error(tmp_path: Path, busy_port: int) -> None:
    with pytest.raises(StackError, match=rf"port {busy_port} .*already in use by PID {os.getpid()}"):
        LocalKafka(make_settings(tmp_path)).up()


def test_missing_java_is_a_clear_error(tmp_path: Path) -> None:
    kafka = LocalKafka(make_settings(tmp_path, java_bin=str(tmp_path / "no-such-java")))
    with pytest.raises(StackError, match=r"Java 17\+ not found .*openjdk-17-jre-headless"):
        kafka.up()
    assert kafka.pid() is None


def test_missing_maven_is_a_clear_error_when_jars_are_not_cached(tmp_path: Path) -> None:
    kafka = LocalKafka(make_settings(tmp_path, cache=tmp_path / "cache", mvn_bin="no-such-mvn"))
    with pytest.raises(StackError, match=r"Maven not found .*apt-get install maven"):
        kafka.up()


def test_remote_bootstrap_needs_local_kafka_off(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="TREADLE_LOCAL_KAFKA=0"):
        LocalKafka(make_settings(tmp_path, kafka_bootstrap_servers="kafka-1:9092,kafka-2:9092"))


def test_failed_start_reports_log_path_and_tail(tmp_path: Path) -> None:
    kafka = LocalKafka(make_settings(tmp_path))
    kafka.data_dir.mkdir(parents=True)
    # storage "formatted" for another node: the broker refuses to start and exits
    (kafka.data_dir / "meta.properties").write_text(
        "version=1\ncluster.id=AAAAAAAAAAAAAAAAAAAAAA\nnode.id=7\ndirectory.id=AAAAAAAAAAAAAAAAAAAAAB\n"
    )
    with pytest.raises(StackError) as info:
        kafka.up(timeout=60)
    message = str(info.value)
    assert "Kafka exited during startup" in message
    assert f"log: {kafka.log_path}" in message and "--- last lines of kafka.log ---" in message
    assert kafka.pid() is None and not kafka.pid_file.path.exists()


def test_jvm_that_cannot_start_is_quoted(tmp_path: Path) -> None:
    kafka = LocalKafka(make_settings(tmp_path, kafka_heap="lots"))
    with pytest.raises(StackError, match=r"(?s)kafka\.stdout\.log ---\nInvalid maximum heap size: -Xmxlots"):
        kafka.up(timeout=60)
    assert kafka.pid() is None


def test_foreign_pid_in_pid_file_is_never_signalled(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    kafka = LocalKafka(make_settings(tmp_path))
    valkey = LocalValkey(make_settings(tmp_path))
    for pid_file in (kafka.pid_file, valkey.pid_file):
        pid_file.write(sleeper.pid)
    assert not kafka.status().running and not valkey.down().running
    kafka.down()
    assert sleeper.poll() is None  # still alive
    assert not kafka.pid_file.path.exists() and not valkey.pid_file.path.exists()


def test_valkey_up_ping_persist_down(tmp_path: Path) -> None:
    valkey = LocalValkey(make_settings(tmp_path))
    try:
        status = valkey.up()
        assert status.running and status.pid is not None and status.address == f"redis://127.0.0.1:{VALKEY_PORT}/0"
        client = redis.Redis.from_url(status.address)
        assert client.ping()
        client.set("k", "v")
        assert valkey.up().pid == status.pid
        assert not valkey.down().running and not pid_alive(status.pid)
        assert (tmp_path / "valkey" / "appendonlydir").is_dir()
        valkey.up()
        assert redis.Redis.from_url(status.address).get("k") == b"v"
    finally:
        valkey.down()


def test_valkey_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with listen(VALKEY_PORT), pytest.raises(StackError, match=rf"port {VALKEY_PORT} .*TREADLE_VALKEY_PORT"):
        LocalValkey(make_settings(tmp_path)).up()


def test_external_services_are_left_alone(tmp_path: Path) -> None:
    stack = LocalStack(make_settings(tmp_path, redis_url="redis://elsewhere:6379/0", local_kafka=False))
    for status in (stack.up(), stack.status(), stack.down()):
        assert not status.kafka.managed and not status.valkey.managed
        assert status.valkey.address == "redis://elsewhere:6379/0"
        assert status.running  # nothing managed, nothing missing
    assert not (tmp_path / "kafka").exists() and not (tmp_path / "valkey").exists()


def test_local_kafka_flag_from_env(tmp_path: Path) -> None:
    assert Settings.from_env(env={"TREADLE_LOCAL_KAFKA": "0"}).local_kafka is False
    assert Settings.from_env(env={}).local_kafka is True


HOLD_CHDB = textwrap.dedent(
    """
    import sys, time
    from chdb import session
    s = session.Session(sys.argv[1])
    s.query("CREATE TABLE IF NOT EXISTS t (x Int32) ENGINE = MergeTree ORDER BY x")
    print("ready", flush=True)
    time.sleep(120)
    """
)

OPEN_CHDB = textwrap.dedent(
    """
    import sys
    import clickhouse_connect
    from treadle.devstack import explain_locked_path
    try:
        clickhouse_connect.get_client(dsn="chdb://" + sys.argv[1])
    except Exception as exc:
        print("FAILED:", type(exc).__name__, file=sys.stderr)
        print(explain_locked_path(sys.argv[1]))
    else:
        print("OPENED")
    """
)


def test_chdb_lock_names_the_holding_pid(tmp_path: Path) -> None:
    path = tmp_path / "chdb"
    assert explain_locked_path(path) is None  # nothing there yet
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_CHDB, str(path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"ready"
        second = subprocess.run(
            [sys.executable, "-c", OPEN_CHDB, str(path)], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
        )
        message = second.stdout.strip().splitlines()[-1]
        assert message.startswith(f"chDB data at {path} is in use by PID {holder.pid} ("), second.stdout
        assert "treadle down" in message and "treadle sql" in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    assert explain_locked_path(path) is None  # status file left behind, but nobody holds it


def test_a_home_formatted_for_three_brokers_is_not_started_as_one_and_is_stopped_as_three(tmp_path: Path) -> None:
    cluster_dir = tmp_path / "kafka"
    cluster_dir.mkdir()
    (cluster_dir / "cluster.id").write_text("x\n")  # what `treadle up --brokers 3` leaves
    stack = LocalStack(make_settings(tmp_path))
    with pytest.raises(StackError, match="TREADLE_KAFKA_BROKERS=3"):
        stack.up()
    assert stack.valkey is not None and stack.valkey.pid() is None  # refused before anything started
    assert stack.kafka is not None and [n.name for n in stack.kafka.nodes] == ["kafka-1", "kafka-2", "kafka-3"]
    assert stack.down().kafka.detail.endswith("(KRaft, 3 nodes; down: kafka-1, kafka-2, kafka-3)")
