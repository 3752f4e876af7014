"""The tier's data path: vLLM's own CPU region registered with the daemon
(zero-copy: a memfd, or vLLM's /dev/shm file), else a staging memfd the
tier copies rows through; and the connection (_Session) that holds what
is registered.
"""

import fcntl
import logging
import os
import queue

from .. import protocol as p
from ..client import KvhostError, Layer
from ..memory import HostBuffer
from ._common import mapping_of as _mapping_of, open_mapped as _open_mapped

log = logging.getLogger("vllm.kvhost")


class _Session:
    """One connection to the daemon and what the tier holds on it: the
    namespace declared, the memory registered and the cache over it. A
    reconnection builds a new one and swaps it in whole."""

    __slots__ = ("client", "ns", "region", "cache", "staged")

    def __init__(self, client):
        self.client, self.ns, self.region, self.cache = client, None, None, None
        self.staged = False  # the cache is over the staging memfd (copy path), not vLLM's region

    def unregister(self):
        """Unregisters the cache and the memory it holds (where the
        connection still works)."""
        for fn, arg in ((self.client.unregister_cache, self.cache), (self.client.unregister_memory, self.region)):
            if arg is not None:
                try:
                    fn(arg)
                except Exception as e:  # the connection's end releases them anyway
                    log.debug("kvhost tier: unregister: %s", e)
        self.cache = self.region = None


class TierDataPath:
    """The data-path half of the tier (_TierImpl): vLLM's region read,
    registered, or staged through a memfd of the tier's own."""

    def _adopt_region(self, np, view):
        """Reads the row geometry of vLLM's region (a (num_blocks,
        row_stride) memoryview) and keeps a uint8 array over it."""
        arr = np.asarray(view)
        if arr.ndim != 2:
            raise ValueError(f"kvhost.vllm: primary_kv_view has shape {arr.shape}: want (num_blocks, row_stride)")
        if arr.strides[1] != arr.itemsize:
            raise ValueError("kvhost.vllm: primary_kv_view rows are not contiguous")
        self._row_bytes = arr.shape[1] * arr.itemsize
        self._row_stride = arr.strides[0]
        self._num_rows = arr.shape[0]
        self._view = view
        self._primary = arr.view(np.uint8) if arr.dtype != np.uint8 else arr

    def _setup_data_path(self, s):
        mode = self._opts["zero_copy"]
        if mode != "off":
            try:
                self._register_primary(s)
                return "zero-copy"
            except (OSError, KvhostError, ValueError) as e:
                if isinstance(e, TimeoutError) or not s.client.connected():
                    raise  # not a refusal: the daemon did not answer
                self._zero_copy_error = str(e)
                if mode == "on":
                    raise RuntimeError(f"kvhost.vllm: zero_copy=on: cannot register vLLM's CPU region with "
                                       f"the daemon: {e}") from e
                log.warning("kvhost tier: zero-copy unavailable (%s); copying through a kvhost memfd", e)
                s.unregister()  # a region registered before its cache was refused
        if self._staging is None:  # else made by a try that failed after it (no daemon at start)
            self._setup_staging()
        self._register_staging(s)
        return "copy"

    def _register_primary_again(self, s):
        """vLLM's region on a new daemon, which may refuse it (a lower
        max_registered_bytes, say): with zero_copy = "auto" the tier then
        copies through its own memfd, as it would have at start; with "on"
        the refusal is raised and the tier keeps trying."""
        try:
            self._register_primary(s)
        except (KvhostError, ValueError, OSError) as e:
            # Refused, or the region cannot be opened here any more; a late
            # answer or a lost connection is tried again.
            if self._opts["zero_copy"] == "on" or isinstance(e, TimeoutError) or not s.client.connected():
                raise
            self._zero_copy_error = str(e)
            log.warning("kvhost tier: the new daemon refuses vLLM's region (%s); copying through a kvhost "
                        "memfd", e)
            s.unregister()
            if self._staging is None:
                self._setup_staging()
            self._register_staging(s)

    def _register_primary(self, s):
        """Registers the memory behind primary_kv_view with the daemon: the
        file the mapping comes from (vLLM's /dev/shm region) or, for a memfd,
        the mapping itself through /proc/self/map_files."""
        addr = self._primary.ctypes.data
        length = (self._num_rows - 1) * self._row_stride + self._row_bytes
        m = _mapping_of(addr, length)
        if m is None:
            raise ValueError("primary_kv_view is not one file mapping")
        lo, hi, off, path = m
        fd = _open_mapped(lo, hi, path)
        try:
            file_off = off + (addr - lo)
            size = file_off + length
            if os.fstat(fd).st_size < size:
                raise ValueError(f"{path or 'the region'} holds {os.fstat(fd).st_size} bytes, want {size}")
            s.region = self._register_fd(s.client, fd, size)
        finally:
            os.close(fd)
        s.cache = s.client.register_cache(s.ns, [Layer(
            s.region, offset=file_off, block_stride=self._row_stride, plane_stride=0,
            num_blocks=self._num_rows)])

    @staticmethod
    def _register_fd(client, fd, size):
        try:
            sealed = fcntl.fcntl(fd, getattr(fcntl, "F_GET_SEALS", 1034)) & getattr(fcntl, "F_SEAL_SHRINK", 2)
        except OSError:
            sealed = 0
        if sealed:
            return client.register_memfd(fd, size)
        # A plain shared-memory file cannot be sealed: register it unsealed
        # (a daemon that cannot guard its copies answers unsupported).
        return client.register_shared_file(fd, size)

    def _setup_staging(self):
        o = self._opts
        threads = o["threads"]
        per = max(1, min(p.MAX_KEYS_PER_REQUEST, o["staging_bytes"] // self._row_bytes // threads))
        slots = per * threads
        self._staging = HostBuffer(slots * self._row_bytes, name="kvhost-vllm-staging")
        self._staging_rows = self._np.frombuffer(self._staging.mmap, dtype=self._np.uint8).reshape(
            slots, self._row_bytes)
        self._slot_ranges = queue.SimpleQueue()
        for i in range(threads):
            self._slot_ranges.put((i * per, per))

    def _register_staging(self, s):
        """Registers the staging memfd on s and a cache of its rows."""
        s.region = s.client.register_buffer(self._staging)
        s.cache = s.client.register_cache(s.ns, [Layer(
            s.region, offset=0, block_stride=self._row_bytes, plane_stride=0,
            num_blocks=len(self._staging_rows))])
        s.staged = True
