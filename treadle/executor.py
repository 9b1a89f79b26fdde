"""`treadle.Executor`: the SDK's executor with the shell's extras: NVML's free GPU memory caps what it advertises,
and its handlers' streams are `treadle.AgentStream`s (with the state reads).

NVML (the `gpu` extra, nvidia-ml-py) is read only by an executor with a GPU budget; without NVML or a device it
says so once and advertises its budget alone.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from streams.sdk.executor import AttemptContext, ExecutorConfig, Handler
from streams.sdk.executor import Executor as _SdkExecutor
from streams.sdk.plans import SubgoalWork
from streams.sdk.stream import AgentStream as _SdkStream
from streams.sdk.sync import AgentStreamSync as _SdkStreamSync
from treadle.agent import AgentStream, AgentStreamSync

__all__ = ["AttemptContext", "Executor", "ExecutorConfig", "Handler", "SubgoalWork"]

log = logging.getLogger(__name__)
_MIB = 1024 * 1024


class NvmlFreeMemory:
    """Free GPU memory (MiB) over every device NVML sees, or None when NVML or a device is missing."""

    def __init__(self) -> None:
        self._reader: Any = None
        try:
            from streams.runtime.gpu import NvmlReader  # the worker extra's prometheus_client comes with it
        except ImportError as exc:
            log.info("executor GPU memory not read (%s): advertising the budget alone", exc)
            return
        reader = NvmlReader()
        why_not = reader.open()
        if why_not is not None:
            log.info("executor GPU memory not read: %s; advertising the budget alone", why_not)
            return
        self._reader = reader

    def __call__(self) -> int | None:
        if self._reader is None:
            return None
        return sum(r.memory_total - r.memory_used for r in self._reader.read()) // _MIB

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


class Executor(_SdkExecutor):
    __doc__ = _SdkExecutor.__doc__

    stream_class: ClassVar[type[_SdkStream]] = AgentStream
    sync_stream_class: ClassVar[type[_SdkStreamSync]] = AgentStreamSync
    _nvml: NvmlFreeMemory | None = None  # opened by start() for an executor with a GPU budget

    async def start(self) -> Executor:
        if self.gpu_free_mb is None and (self.config.gpu_memory_mb > 0 or self.config.gpus > 0):
            self._nvml = NvmlFreeMemory()
            self.gpu_free_mb = self._nvml
        return await super().start()

    async def stop(self, *, abandon: bool = False) -> None:
        try:
            await super().stop(abandon=abandon)
        finally:
            if self._nvml is not None:
                self._nvml.close()
                self._nvml = None
