"""checkpointless: fault-tolerant distributed PyTorch training without checkpoints.

The public face is small: a ``Session`` wraps a training loop; ``Stateful`` is
the protocol for extra state to move; faults and configs are for launchers and
tests.
"""

from checkpointless.config import JobConfig, RecoveryConfig
from checkpointless.devices import local_device
from checkpointless.errors import CheckpointlessError, FatalError
from checkpointless.fault_grammar import FaultSpec, parse_fault
from checkpointless.progress import Between
from checkpointless.session import Attempt, Session
from checkpointless.state import Stateful

__all__ = [
    "Attempt",
    "Between",
    "CheckpointlessError",
    "FatalError",
    "FaultSpec",
    "JobConfig",
    "RecoveryConfig",
    "Session",
    "Stateful",
    "local_device",
    "parse_fault",
]
__version__ = "0.1.0"
