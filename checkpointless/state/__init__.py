"""Transferable training state: ``registry`` (what a rank registers), ``codec`` (its encoding),
``transfer`` (``send_state``/``recv_state``, peer to peer, authenticated), ``frozen`` (frozen
parameters a receiver holds alike are not sent: a LoRA recovery moves the adapter), ``digests``
(what replicas compare, the final state's digest)."""

from checkpointless.errors import IntegrityError as IntegrityError
from checkpointless.state import frozen as frozen
from checkpointless.state.digests import combined_digest as combined_digest
from checkpointless.state.digests import digest_state as digest_state
from checkpointless.state.digests import entry_digests as entry_digests
from checkpointless.state.digests import first_difference as first_difference
from checkpointless.state.registry import Stateful as Stateful
from checkpointless.state.registry import StateRegistry as StateRegistry
from checkpointless.state.transfer import TransferStats as TransferStats
from checkpointless.state.transfer import recv_state as recv_state
from checkpointless.state.transfer import send_state as send_state
