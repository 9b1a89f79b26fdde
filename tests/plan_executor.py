"""A small plan executor for the integration tests, run as its own process so a test can kill it with -9.

It follows the executor contract of docs/plans.md over aiokafka and the project's codec (treadle.Executor is built
separately): it reads `<prefix>.work.<class>` with its own consumer group `<prefix>.executor.<id>`, runs only work
counted against it (once per attempt key), reports RUNNING, HEARTBEAT, SUCCEEDED or FAILED, and heartbeats its
capacity less what it runs. The "handler" is driven by the work's params: `seconds` to sleep, `fail_attempts` (the
attempts up to that number fail) and `always_fail`. Each start and end is logged as a JSON line (for the test).

    python -m tests.plan_executor BOOTSTRAP PREFIX EXECUTOR_ID CLASS GPU_MB GPUS CPU LOG_PATH
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from topics.codec import AvroCodec
from topics.names import EXECUTOR_HEARTBEAT, PLAN_EVENTS_KEY, SUBGOAL_RELEASED, SUBGOAL_STATUS

HEARTBEAT_S = 0.5
VALID_FOR_S = 3.0
STATUS_EVERY_S = 1.0


class ScriptedExecutor:
    def __init__(self, servers: str, prefix: str, executor_id: str, resource_class: str, capacity: tuple[int, int, int],
                 log_path: Path) -> None:  # fmt: skip
        self.servers, self.prefix, self.id, self.cls = servers, prefix, executor_id, resource_class
        self.capacity = capacity
        self.log_path = log_path
        self.codec = AvroCodec()
        self.running: dict[str, tuple[int, int, int]] = {}
        self.seen: set[str] = set()
        self.last_sent_at = 0
        self.producer: AIOKafkaProducer | None = None

    def now(self) -> int:
        self.last_sent_at = max(int(time.time() * 1_000_000), self.last_sent_at + 1)
        return self.last_sent_at

    async def send(self, schema: str, record: dict[str, Any]) -> None:
        assert self.producer is not None
        await self.producer.send_and_wait(
            f"{self.prefix}.plan_events", self.codec.encode(schema, record), key=PLAN_EVENTS_KEY.encode()
        )

    def log(self, **fields: Any) -> None:
        with self.log_path.open("a") as out:
            out.write(json.dumps({"executor": self.id, "t": time.time(), **fields}) + "\n")

    async def heartbeats(self) -> None:
        while True:
            used = [sum(p[i] for p in self.running.values()) for i in range(3)]
            await self.send(EXECUTOR_HEARTBEAT, {
                "executor_id": self.id, "resource_class": self.cls, "free_gpu_memory_mb": self.capacity[0] - used[0],
                "free_gpus": self.capacity[1] - used[1], "free_cpu": self.capacity[2] - used[2],
                "running": sorted(self.running), "valid_for_s": VALID_FOR_S, "host": "test", "sent_at": self.now(),
            })  # fmt: skip
            await asyncio.sleep(HEARTBEAT_S)

    async def status(self, work: dict[str, Any], state: str, **extra: Any) -> None:
        envelope = {
            "event_id": str(uuid.uuid4()), "session_id": work["session_id"], "agent_id": self.id,
            "episode_id": work["episode_id"], "logical_event_id": work["decision_id"], "seq": 0,
            "event_time": self.now(), "policy_version": "", "trace_id": "", "attributes": {},
        }  # fmt: skip
        await self.send(SUBGOAL_STATUS, {
            "envelope": envelope, "plan_id": work["plan_id"], "subgoal_id": work["subgoal_id"],
            "attempt": work["attempt"], "state": state, "executor_id": self.id, "output_ref": None,
            "error_class": None, "error": None, **extra,
        })  # fmt: skip

    async def run(self, work: dict[str, Any], key: str) -> None:
        params = json.loads(work["params_json"])
        seconds = float(params.get("seconds", 0.3))
        profile = work["profile"]
        self.running[key] = (profile["gpu_memory_mb"], profile["gpus"], profile["cpu"])
        self.log(event="start", key=key, seconds=seconds)
        await self.status(work, "RUNNING")
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(left, STATUS_EVERY_S))
            if time.monotonic() < end:
                await self.status(work, "HEARTBEAT")
        failed = params.get("always_fail") or work["attempt"] <= int(params.get("fail_attempts", 0))
        if failed:
            await self.status(work, "FAILED", error_class="InjectedFailure", error="injected by the test")
        else:
            await self.status(work, "SUCCEEDED", output_ref=f"test://{key}")
        del self.running[key]
        self.log(event="end", key=key, failed=bool(failed))

    async def main(self) -> None:
        self.producer = AIOKafkaProducer(bootstrap_servers=self.servers, acks="all", linger_ms=0)
        await self.producer.start()
        beats = asyncio.create_task(self.heartbeats())
        topic = f"{self.prefix}.work.{self.cls}"
        admin = AIOKafkaAdminClient(bootstrap_servers=self.servers)
        await admin.start()
        while topic not in await admin.list_topics():  # the scheduler makes it with the first release
            await asyncio.sleep(0.2)
        await admin.close()
        consumer = AIOKafkaConsumer(
            topic, bootstrap_servers=self.servers, group_id=f"{self.prefix}.executor.{self.id}",
            auto_offset_reset="earliest", enable_auto_commit=True, metadata_max_age_ms=1000,
        )  # fmt: skip
        await consumer.start()
        tasks = set()
        self.log(event="ready")
        try:
            async for message in consumer:
                _, work = self.codec.decode(message.value, SUBGOAL_RELEASED)
                key = "/".join([work["session_id"], work["plan_id"], work["subgoal_id"], str(work["attempt"])])
                if work["executor_id"] != self.id or key in self.seen:
                    continue
                self.seen.add(key)
                task = asyncio.create_task(self.run(work, key))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            beats.cancel()
            await consumer.stop()
            await self.producer.stop()


if __name__ == "__main__":
    servers, prefix, executor_id, cls, gpu_mb, gpus, cpu, log_path = sys.argv[1:9]
    asyncio.run(
        ScriptedExecutor(servers, prefix, executor_id, cls, (int(gpu_mb), int(gpus), int(cpu)), Path(log_path)).main()
    )
