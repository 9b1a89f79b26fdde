"""The KRaft Apache Kafka brokers that treadle runs itself: one node, or a cluster of three.

No Kafka package exists for this platform and the PyPI broker wheels lose data across restarts, so
the real broker is run from Maven Central jars: resolved once with Maven into a cache folder, the
storage formatted on first start only, and the JVM started detached so it outlives `treadle up`.
One broker keeps its data under TREADLE_HOME/kafka/data; a cluster (TREADLE_KAFKA_BROKERS=3) runs
combined broker+controller nodes under TREADLE_HOME/kafka/node-<id>, node i on the ports of node 1
plus 2*(i-1), sharing one cluster id so the three form one KRaft quorum (LocalKafkaCluster).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Coroutine
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from streams.runtime.processes import (
    PidFile,
    ServiceStatus,
    StackError,
    failure,
    log_size,
    pid_alive,
    port_accepts,
    port_free,
    port_taken_message,
    proc_cmdline,
    spawn_detached,
    stop_pid,
    tail,
)
from topics.settings import KAFKA_MAX_MESSAGE_BYTES, Settings, min_insync_replicas

POM = Path(str(resources.files("treadle.devstack") / "pom.xml"))  # package data: Kafka's jars, for Maven
LOCAL_HOSTS = {"127.0.0.1", "localhost"}
MIN_JAVA = 17

T = TypeVar("T")

LOG4J2 = """\
# Written by treadle (treadle/devstack/kafka.py) on every start; edits are overwritten.
name = treadle-kafka
appender.file.type = RollingFile
appender.file.name = file
appender.file.fileName = {log}
appender.file.filePattern = {log}.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 50MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.statechange.name = state.change.logger
logger.statechange.level = WARN
logger.authorizer.name = kafka.authorizer.logger
logger.authorizer.level = WARN
"""


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine from sync code, also when the caller already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def new_cluster_id() -> str:
    """A Kafka cluster id (Uuid: 16 random bytes, url-safe base64), without a JVM start."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not text.startswith("-"):  # Kafka avoids these: they read as command-line flags
            return text


def java_major_version(java: str) -> int | None:
    """The major version `java -version` reports (8 for 1.8), or None when it cannot be read."""
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


class LocalKafka:
    """Start, stop and inspect one local broker described by `settings`: the only one, or node `node_id` of
    the `settings.kafka_brokers` nodes of a local cluster."""

    def __init__(self, settings: Settings, node_id: int = 1) -> None:
        self.settings = settings
        self.node_id = node_id
        self.nodes = settings.kafka_brokers
        host, first_port = self._local_address(settings)
        step = 2 * (node_id - 1)  # node i: 19092+2(i-1) and 19093+2(i-1), as compose.yaml's host ports
        self.host, self.port = host, first_port + step
        self.controller_port = settings.kafka_controller_port + step
        kafka_dir = (settings.home / "kafka").resolve()  # absolute: the JVM keeps the caller's cwd
        self.cluster_dir = kafka_dir
        self.dir = kafka_dir if self.nodes == 1 else kafka_dir / f"node-{node_id}"
        self.name = "kafka" if self.nodes == 1 else f"kafka-{node_id}"
        self.data_dir = self.dir / "data"
        self.config_path = self.dir / "server.properties"
        self.log4j_path = self.dir / "log4j2.properties"
        self.pid_file = PidFile(self.dir / "kafka.pid", self._is_ours)
        self.logs_dir = settings.logs_dir.resolve()
        self.log_path = self.logs_dir / f"{self.name}.log"
        self.stdout_path = self.logs_dir / f"{self.name}.stdout.log"
        self.cache_dir = settings.cache_dir.resolve()
        self.libs_dir = self.cache_dir / f"kafka-{settings.kafka_version}" / "libs"

    @staticmethod
    def _local_address(settings: Settings) -> tuple[str, int]:
        """Node 1's address: the first of KAFKA_BOOTSTRAP_SERVERS (a cluster's settings list every node)."""
        servers = settings.kafka_bootstrap_servers.strip()
        first = servers.split(",")[0]
        host, _, port = first.rpartition(":")
        if ("," in servers and settings.kafka_brokers == 1) or host not in LOCAL_HOSTS or not port.isdigit():
            raise StackError(
                f"KAFKA_BOOTSTRAP_SERVERS={servers} is not a single 127.0.0.1:<port> address, so treadle "
                "cannot run a local broker there; set TREADLE_LOCAL_KAFKA=0 to use that cluster as it is"
            )
        return "127.0.0.1", int(port)

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    # -- inspection ---------------------------------------------------------------------------

    def _is_ours(self, pid: int) -> bool:
        argv = proc_cmdline(pid)
        if argv is None:  # no /proc: trust the PID file
            return pid_alive(pid)
        return "kafka.Kafka" in argv and str(self.config_path) in argv

    def pid(self) -> int | None:
        """PID of our running broker, or None (a stale PID file is cleaned up)."""
        return self.pid_file.live_pid()

    def status(self) -> ServiceStatus:
        pid = self.pid()
        shape = "single node" if self.nodes == 1 else f"node {self.node_id} of {self.nodes}"
        return ServiceStatus(
            name=self.name,
            managed=True,
            running=pid is not None,
            address=self.bootstrap_servers,
            pid=pid,
            log_path=self.log_path,
            data_dir=self.data_dir,
            detail=f"Apache Kafka {self.settings.kafka_version} (KRaft, {shape})",
        )

    # -- prerequisites ------------------------------------------------------------------------

    def check_java(self) -> str:
        """Path of a Java 17+ binary; raises StackError with the install command otherwise."""
        java = shutil.which(self.settings.java_bin)
        hint = "install OpenJDK 17 (apt-get install openjdk-17-jre-headless) or point TREADLE_JAVA_BIN at one"
        if java is None:
            raise StackError(f"Java {MIN_JAVA}+ not found ({self.settings.java_bin!r} is not on PATH): {hint}")
        major = java_major_version(java)
        if major is None or major < MIN_JAVA:
            found = "an unreadable version" if major is None else f"Java {major}"
            raise StackError(f"Java {MIN_JAVA}+ is needed for Kafka but {java} is {found}: {hint}")
        return java

    def ensure_jars(self) -> Path:
        """Download the broker's runtime jars once (Maven) into the cache; returns the libs folder."""
        marker = self.libs_dir / f"kafka_2.13-{self.settings.kafka_version}.jar"
        if marker.exists():
            return self.libs_dir
        mvn = shutil.which(self.settings.mvn_bin)
        if mvn is None:
            raise StackError(
                f"Maven not found ({self.settings.mvn_bin!r} is not on PATH); it is needed once to download "
                f"Kafka {self.settings.kafka_version}: install it (apt-get install maven) or point "
                "TREADLE_MVN_BIN at it"
            )
        if not POM.exists():
            raise StackError(f"{POM} is missing: run treadle from its source checkout to start a local Kafka")
        self.libs_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="libs-", dir=self.libs_dir.parent))
        cmd = [
            mvn, "-q", "-B", f"-Dmaven.repo.local={self.cache_dir / 'm2'}", "-f", str(POM),
            "dependency:copy-dependencies", f"-DoutputDirectory={staging}", "-DincludeScope=runtime",
            f"-Dkafka.version={self.settings.kafka_version}",
        ]  # fmt: skip
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=self.libs_dir.parent)
        except subprocess.TimeoutExpired as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise StackError("Maven took over 15 minutes to download Kafka's jars; check the network") from exc
        if out.returncode != 0 or not (staging / marker.name).exists():
            shutil.rmtree(staging, ignore_errors=True)
            last = "\n".join((out.stdout + out.stderr).strip().splitlines()[-15:])
            raise StackError(
                f"Maven could not download Kafka {self.settings.kafka_version} from Maven Central "
                f"(exit {out.returncode}); check the network or TREADLE_KAFKA_VERSION:\n{last}"
            )
        shutil.rmtree(self.libs_dir, ignore_errors=True)
        staging.replace(self.libs_dir)
        return self.libs_dir

    def _check_ports(self) -> None:
        for port, what in (
            (self.port, "KAFKA_BOOTSTRAP_SERVERS"),
            (self.controller_port, "TREADLE_KAFKA_CONTROLLER_PORT"),
        ):
            if not port_free(port):
                raise StackError(
                    port_taken_message(
                        port,
                        "kafka",
                        f"stop it, or choose another port with {what} (or TREADLE_LOCAL_KAFKA=0 to use that broker)",
                    )
                )

    # -- configuration ------------------------------------------------------------------------

    def _write_config(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        rf = self.settings.replication_factor
        isr = str(min_insync_replicas(rf))
        voters = ",".join(
            f"{i}@{self.host}:{self.settings.kafka_controller_port + 2 * (i - 1)}" for i in range(1, self.nodes + 1)
        )
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.host}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.data_dir),
            "num.partitions": str(self.settings.partitions),
            "default.replication.factor": str(rf),
            # with 3 replicas an acks=all write needs 2 in sync: one broker may be down without stopping writes
            # or losing an acknowledged record (topics treadle creates say so too; Faust's changelogs inherit it)
            "min.insync.replicas": isr,
            "offsets.topic.replication.factor": str(rf),
            "transaction.state.log.replication.factor": str(rf),
            "transaction.state.log.min.isr": isr,
            "share.coordinator.state.topic.replication.factor": str(rf),
            "share.coordinator.state.topic.min.isr": isr,
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",  # topics come from the catalog (co-partitioned)
            # what the producers' max_request_size allows (topics/settings.py); Faust's changelogs inherit it
            "message.max.bytes": str(KAFKA_MAX_MESSAGE_BYTES),
            "replica.fetch.max.bytes": str(KAFKA_MAX_MESSAGE_BYTES),
            "num.network.threads": "2",
            "num.io.threads": "4",
            "num.recovery.threads.per.data.dir": "1",
        }
        lines = ["# Written by treadle (treadle/devstack/kafka.py) on every start; edits are overwritten."]
        lines += [f"{key}={value}" for key, value in props.items()]
        self.config_path.write_text("\n".join(lines) + "\n")
        self.log4j_path.write_text(LOG4J2.format(log=self.log_path))

    def _format_storage(self, java: str) -> None:
        """Format the KRaft storage once; a data folder with meta.properties keeps its data."""
        if (self.data_dir / "meta.properties").exists():
            return
        cmd = [
            java, "-Xmx256m", "-cp", f"{self.libs_dir}/*",
            "kafka.tools.StorageTool", "format", "-t", self._cluster_id(), "-c", str(self.config_path),
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            last = "\n".join((out.stdout + out.stderr).strip().splitlines()[-15:])
            raise StackError(f"formatting Kafka storage in {self.data_dir} failed (exit {out.returncode}):\n{last}")

    def _cluster_id(self) -> str:
        """One broker's own id; a cluster's nodes share the id kept in TREADLE_HOME/kafka/cluster.id."""
        if self.nodes == 1:
            return new_cluster_id()
        path = self.cluster_dir / "cluster.id"
        if not path.exists():
            self.cluster_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(new_cluster_id() + "\n")
        return path.read_text().strip()

    # -- lifecycle ----------------------------------------------------------------------------

    def up(self, timeout: float = 90.0) -> ServiceStatus:
        """Start the broker (no-op when ours already runs) and wait until a real client call works."""
        started = self.start()
        if started is not None:
            self.wait_ready(started, timeout)
        return self.status()

    def start(self) -> tuple[int, tuple[int, int]] | None:
        """Spawn the JVM without waiting for it: (pid, log offsets) for `wait_ready`, None when ours already runs.

        A cluster's nodes are all spawned before any is waited for: a node answers only once a quorum runs."""
        if self.pid() is not None:
            return None
        java = self.check_java()
        self._check_ports()
        self.ensure_jars()
        self._write_config()
        self._format_storage(java)
        # The parallel collector, not G1: with a heap this small its young collections take milliseconds, and G1's
        # concurrent work cost the broker a sixth more CPU on the core it shares with the sink (weaving bench
        # latency run, 2 cores: 25-26% of a core against 31-32%; the worker's part p99 0.9-1.1 s against 1.2-1.9 s).
        cmd = [
            java, f"-Xmx{self.settings.kafka_heap}", "-XX:+UseParallelGC",
            "-XX:+ExitOnOutOfMemoryError", f"-XX:ErrorFile={self.logs_dir}/hs_err_pid%p.log",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.log4j_path}", f"-Dkafka.logs.dir={self.logs_dir}",
            "-cp", f"{self.libs_dir}/*", "kafka.Kafka", str(self.config_path),
        ]  # fmt: skip
        starts = (log_size(self.log_path), log_size(self.stdout_path))
        pid = spawn_detached(cmd, self.stdout_path)
        self.pid_file.write(pid)
        return pid, starts

    def wait_ready(self, started: tuple[int, tuple[int, int]], timeout: float = 90.0) -> None:
        """Wait until the broker `start` spawned answers; stops it and raises StackError when it does not."""
        pid, starts = started
        try:
            self._wait_ready(pid, timeout, starts)
        except StackError:
            stop_pid(pid, timeout=10)
            self.pid_file.remove()
            raise

    def kill(self) -> int | None:
        """SIGKILL our broker (a crash, for fault tests); returns the PID killed, None when none ran."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            while pid_alive(pid):
                time.sleep(0.05)
            self.pid_file.remove()
        return pid

    def _wait_ready(self, pid: int, timeout: float, starts: tuple[int, int]) -> None:
        what = "Kafka" if self.nodes == 1 else f"Kafka node {self.node_id}"
        deadline = time.monotonic() + timeout
        last_error = "no answer yet"
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                raise failure(
                    f"{what} exited during startup ({self.bootstrap_servers}).",
                    self.log_path,
                    starts[0],
                    (self.stdout_path, starts[1]),
                )
            if not port_accepts(self.port):
                last_error = "the port does not accept connections yet"
                time.sleep(0.25)
                continue
            try:
                if _run_sync(self._probe()):
                    return
                last_error = "the broker reports no live brokers yet"
            except Exception as exc:  # any client error means "not yet"; the last one is reported
                last_error = f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)
        raise failure(
            f"{what} did not answer on {self.bootstrap_servers} within {timeout:.0f}s ({last_error}).",
            self.log_path,
            starts[0],
            (self.stdout_path, starts[1]),
        )

    async def _probe(self) -> bool:
        """A real client round trip: the admin client's metadata request lists a live broker."""
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(
            bootstrap_servers=self.bootstrap_servers, request_timeout_ms=3000, connections_max_idle_ms=5000
        )
        try:
            await asyncio.wait_for(admin.start(), 5)
            cluster = await asyncio.wait_for(admin.describe_cluster(), 5)
            return len(cluster.get("brokers") or ()) >= self.nodes  # a restarted node: until it rejoined
        finally:
            await admin.close()

    def down(self, timeout: float = 30.0) -> ServiceStatus:
        """Stop our broker by PID: SIGTERM (clean shutdown flushes the log), SIGKILL after `timeout`."""
        pid = self.pid()
        if pid is not None:
            stop_pid(pid, timeout)
            self.pid_file.remove()
        return self.status()

    def log_tail(self, lines: int = 25) -> str:
        return tail(self.log_path, lines)


def formatted_brokers(settings: Settings) -> int | None:
    """How many local brokers TREADLE_HOME's Kafka data was formatted for (None when there is none yet)."""
    kafka_dir = settings.home / "kafka"
    if (kafka_dir / "cluster.id").exists():
        return 3
    if (kafka_dir / "data" / "meta.properties").exists():
        return 1
    return None


class LocalKafkaCluster:
    """The `settings.kafka_brokers` local nodes as one service: started together, stopped together."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.formatted_for = formatted_brokers(settings)
        if self.formatted_for is not None and self.formatted_for != settings.kafka_brokers:
            # `down` and `status` follow what TREADLE_HOME holds, so a forgotten TREADLE_KAFKA_BROKERS stops it all
            settings = settings.model_copy(update={"kafka_brokers": self.formatted_for})
        self.nodes = [LocalKafka(settings, node_id) for node_id in range(1, settings.kafka_brokers + 1)]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(node.bootstrap_servers for node in self.nodes)

    def node(self, node_id: int) -> LocalKafka:
        return self.nodes[node_id - 1]

    def status(self) -> ServiceStatus:
        states = [node.status() for node in self.nodes]
        if len(states) == 1:
            return states[0]
        running = [s for s in states if s.running]
        down = [s.name for s in states if not s.running]
        return ServiceStatus(
            name="kafka",
            managed=True,
            running=len(running) == len(states),
            address=self.bootstrap_servers,
            pid=states[0].pid,
            log_path=states[0].log_path,
            data_dir=self.nodes[0].cluster_dir,
            detail=f"Apache Kafka {self.settings.kafka_version} (KRaft, {len(states)} nodes"
            + (f"; down: {', '.join(down)})" if down else ")"),
        )

    def check_shape(self) -> None:
        """StackError when TREADLE_HOME's Kafka data was formatted for another number of brokers."""
        if self.formatted_for is not None and self.formatted_for != self.settings.kafka_brokers:
            raise StackError(
                f"{self.nodes[0].cluster_dir} holds the data of {self.formatted_for} local broker(s), not "
                f"{self.settings.kafka_brokers}: set TREADLE_KAFKA_BROKERS={self.formatted_for} (`treadle up --brokers "
                f"{self.formatted_for}`), or use another TREADLE_HOME"
            )

    def up(self, timeout: float = 120.0) -> ServiceStatus:
        """Spawn every node that is not running, then wait for each (a node answers once a quorum runs)."""
        self.check_shape()
        started: list[tuple[LocalKafka, tuple[int, tuple[int, int]]]] = []
        try:
            for node in self.nodes:
                spawned = node.start()
                if spawned is not None:
                    started.append((node, spawned))
            for node, spawned in started:
                node.wait_ready(spawned, timeout)
        except StackError:
            for node, _ in started:  # what this call started; nodes that ran before keep running
                node.down(timeout=10)
            raise
        return self.status()

    def down(self, timeout: float = 30.0) -> ServiceStatus:
        """Stop every node by PID at once: one by one, the last two would wait for a quorum that is gone."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(self.nodes)) as pool:
            list(pool.map(lambda node: node.down(timeout), self.nodes))
        return self.status()

    def log_tail(self, lines: int = 25) -> str:
        return "\n".join(f"{node.name}:\n{node.log_tail(lines)}" for node in self.nodes)
