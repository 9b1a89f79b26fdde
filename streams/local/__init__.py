"""The local stack: a KRaft Kafka broker and a Valkey server that treadle starts and stops itself.

Both run detached with PID files under TREADLE_HOME so they outlive `treadle up`; see stack.py.
"""

from streams.local.chdb_lock import explain_locked_path
from streams.local.kafka import LocalKafka
from streams.local.process import ServiceStatus, StackError
from streams.local.stack import LocalStack, StackStatus
from streams.local.valkey import LocalValkey

__all__ = [
    "LocalKafka",
    "LocalStack",
    "LocalValkey",
    "ServiceStatus",
    "StackError",
    "StackStatus",
    "explain_locked_path",
]
