"""GPU telemetry through NVML: Prometheus gauges and ResourceSample events, one per device per period.

Why both: gauges are for dashboards and alerts; events land in ClickHouse (resource_samples) where
GPU idle time can be joined with tool latency in SQL. Without NVML or without a device the worker
says so once and carries on: no errors, and no GPU metric families at all (an empty family would
read as "a GPU at 0%").
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from streams.runtime.metrics import GpuMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuReading:
    """What NVML reports for one device at one instant, in NVML's units."""

    index: int
    uuid: str
    name: str
    utilization_percent: int
    memory_used: int
    memory_total: int
    power_milliwatts: int | None


def sample_record(host: str, reading: GpuReading, sampled_at_us: int) -> dict[str, Any]:
    """The ResourceSample event for a reading (NVML percent and milliwatts become ratio and watts)."""
    power = None if reading.power_milliwatts is None else reading.power_milliwatts / 1000.0
    return {
        "sample_id": f"{host}/{reading.uuid}/{sampled_at_us}",
        "host": host,
        "gpu_index": reading.index,
        "gpu_uuid": reading.uuid,
        "gpu_name": reading.name,
        "utilization": reading.utilization_percent / 100.0,
        "memory_used_bytes": reading.memory_used,
        "memory_total_bytes": reading.memory_total,
        "power_watts": power,
        "sampled_at": sampled_at_us,
    }


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older pynvml returns bytes


class NvmlReader:
    """Reads every device through pynvml (the nvidia-ml-py package); `open()` says whether NVML is usable."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []

    def open(self) -> str | None:
        """None when at least one GPU can be read, else why not (for the one log line)."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded...
            return f"NVML is not available ({exc or type(exc).__name__})"
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            pynvml.nvmlShutdown()
            return "NVML found no GPU"
        self._nvml = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        return None

    def read(self) -> list[GpuReading]:
        nvml = self._nvml
        readings = []
        for index, handle in enumerate(self._handles):
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                power: int | None = nvml.nvmlDeviceGetPowerUsage(handle)
            except nvml.NVMLError:  # not supported on some boards
                power = None
            readings.append(
                GpuReading(
                    index=index,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    utilization_percent=nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                    memory_used=memory.used,
                    memory_total=memory.total,
                    power_milliwatts=power,
                )
            )
        return readings

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None


class GpuTelemetry:
    """Samples every GPU of this host into gauges of `registry` and hands each sample to `emit`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        reader: NvmlReader | None = None,
        host: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = registry
        self.reader = reader or NvmlReader()
        self.host = host or socket.gethostname()
        self.clock = clock
        self.metrics: GpuMetrics | None = None

    def start(self) -> bool:
        """True when there are GPUs to sample; otherwise logs one line and stays off."""
        why_not = self.reader.open()
        if why_not is not None:
            log.info("GPU telemetry off: %s; no treadle_gpu_* metrics on this worker.", why_not)
            return False
        self.metrics = GpuMetrics(self.registry)
        return True

    def sample(self) -> list[dict[str, Any]]:
        """Read every device once: update the gauges, return the ResourceSample records."""
        if self.metrics is None:
            return []
        at_us = int(self.clock() * 1_000_000)
        records = []
        for reading in self.reader.read():
            record = sample_record(self.host, reading, at_us)
            gpu = str(reading.index)
            self.metrics.utilization.labels(gpu).set(record["utilization"])
            self.metrics.memory_used.labels(gpu).set(record["memory_used_bytes"])
            if record["power_watts"] is not None:
                self.metrics.power.labels(gpu).set(record["power_watts"])
            records.append(record)
        return records

    def stop(self) -> None:
        self.reader.close()
