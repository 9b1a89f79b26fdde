"""GPU telemetry: readings become exact samples; without NVML the worker says so once and exposes no GPU family.

The GPU path runs where NVML sees a device (`make test-gpu` on a GPU machine); here it is skipped, not passed.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from streams.runtime.gpu import GpuReading, GpuTelemetry, NvmlReader, sample_record


def nvml_sees_a_gpu() -> bool:
    reader = NvmlReader()
    try:
        return reader.open() is None
    finally:
        reader.close()


HAS_GPU = nvml_sees_a_gpu()

readings = st.builds(
    GpuReading,
    index=st.integers(0, 15),
    uuid=st.uuids().map(lambda u: f"GPU-{u}"),
    name=st.sampled_from(["NVIDIA H200", "NVIDIA A100-SXM4-80GB"]),
    utilization_percent=st.integers(0, 100),
    memory_used=st.integers(0, 2**40),
    memory_total=st.integers(2**30, 2**41),
    power_milliwatts=st.one_of(st.none(), st.integers(0, 1_000_000)),
)


@given(readings, st.integers(0, 2**62))
def test_a_reading_becomes_a_resource_sample_in_si_units(reading: GpuReading, at_us: int) -> None:
    record = sample_record("host-a", reading, at_us)
    assert record["utilization"] == reading.utilization_percent / 100 and 0 <= record["utilization"] <= 1
    assert record["memory_used_bytes"] == reading.memory_used
    if reading.power_milliwatts is None:
        assert record["power_watts"] is None
    else:
        assert record["power_watts"] == pytest.approx(reading.power_milliwatts / 1000)
    assert record["sample_id"] == f"host-a/{reading.uuid}/{at_us}"  # same sample, same id: replays collapse


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU; the no-GPU path needs a machine without NVML")
def test_without_nvml_one_log_line_no_metrics_no_samples(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    telemetry = GpuTelemetry(registry)
    with caplog.at_level(logging.INFO, logger="streams.runtime.gpu"):
        assert telemetry.start() is False
    lines = [r.getMessage() for r in caplog.records if r.name == "streams.runtime.gpu"]
    assert len(lines) == 1 and lines[0].startswith("GPU telemetry off: ")
    assert telemetry.sample() == []
    assert b"treadle_gpu" not in generate_latest(registry)
    telemetry.stop()


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU that NVML can read (run `make test-gpu` on a GPU machine)")
def test_on_a_gpu_every_device_is_sampled_into_gauges_and_events() -> None:
    registry = CollectorRegistry()
    telemetry = GpuTelemetry(registry, host="gpu-host")
    assert telemetry.start() is True
    try:
        records = telemetry.sample()
    finally:
        telemetry.stop()
    assert records and {r["gpu_index"] for r in records} == set(range(len(records)))
    for record in records:
        assert 0 <= record["utilization"] <= 1
        assert 0 < record["memory_used_bytes"] <= record["memory_total_bytes"]
        gpu = str(record["gpu_index"])
        assert registry.get_sample_value("treadle_gpu_memory_used_bytes", {"gpu": gpu}) == record["memory_used_bytes"]
        assert registry.get_sample_value("treadle_gpu_utilization_ratio", {"gpu": gpu}) == record["utilization"]
