"""The local stack: a KRaft Kafka broker and a Valkey server that treadle starts and stops itself.

Both run detached with PID files under TREADLE_HOME so they outlive `treadle up`; see stack.py.
"""

from sinks.chdb_lock import explain_locked_path
from streams.runtime.processes import ServiceStatus, StackError
from treadle.devstack.kafka import LocalKafka
from treadle.devstack.stack import LocalStack, StackStatus
from treadle.devstack.valkey import LocalValkey

__all__ = [
    "LocalKafka",
    "LocalStack",
    "LocalValkey",
    "ServiceStatus",
    "StackError",
    "StackStatus",
    "explain_locked_path",
]
