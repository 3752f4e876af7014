"""kvhost: client of the kvhost node-local KV-cache storage daemon.

Python, standard library only (torch optional), with one optional C module
(kvhost._lookup, the shared lookup table's probe; kvhost.lookuptable falls
back to Python without it). See docs/protocol.md.
"""

from .client import (Client, ConnectionLost, Geometry, Job, KvhostError, Layer, Namespace, Removal,
                     RemovalBatch, RemovalSubscription, Result, UnsupportedError, default_socket)
from .memory import HostBuffer, cuda_ipc_handle, daemon_device, device_uuid, seal_shrink, torch_host_tensor
from .protocol import (NO_BLOCK, OUTCOME_CANCELLED, OUTCOME_FAILED, OUTCOME_LOADED, OUTCOME_MISSING,
                       OUTCOME_NOT_ADMITTED, OUTCOME_PRESENT, OUTCOME_STORED, OUTCOMES, CODES)

__all__ = ["Client", "ConnectionLost", "Geometry", "HostBuffer", "Job", "KvhostError", "Layer",
           "Namespace", "Removal", "RemovalBatch", "RemovalSubscription", "Result", "UnsupportedError", "cuda_ipc_handle", "daemon_device", "device_uuid",
           "default_socket", "seal_shrink", "torch_host_tensor", "NO_BLOCK",
           "OUTCOMES", "CODES", "OUTCOME_STORED", "OUTCOME_PRESENT", "OUTCOME_NOT_ADMITTED",
           "OUTCOME_LOADED", "OUTCOME_MISSING", "OUTCOME_FAILED", "OUTCOME_CANCELLED"]
__version__ = "0.1.0"
