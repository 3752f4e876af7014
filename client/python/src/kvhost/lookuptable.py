"""Read-only mapping of the daemon's shared lookup table.

The daemon keeps, next to its socket, a table of the keys its index holds
(docs/protocol.md, "Shared lookup table"); a client maps it and answers
lookups itself, with no round trip and no wait behind the daemon's data
path. This module reads the format internal/lookuptable writes.

The probe runs in C (kvhost._lookup) where that module was built (pip
install builds it when a C compiler and Python's headers are present;
`make python-ext` in a checkout) and in Python otherwise, with the same
answers; NATIVE says which this process uses. The Python probe answers only
on x86-64 (ORDERED_LOADS): elsewhere it sends every lookup to the daemon.
"""

import functools
import hashlib
import mmap
import os
import platform
import stat
import struct
import sys

from kvhost.protocol import MAX_KEYS_PER_REQUEST as MAX_KEYS, check_keys

MAGIC = b"KVHLKT01"
VERSION = 1
HEADER_SIZE = 64
MIN_SLOTS = 1 << 10

FLAG_MISSES_FINAL = 1 << 0
FLAG_INCOMPLETE = 1 << 1
FLAG_CLOSED = 1 << 2

_SEQ, _FLAGS = 2, 3  # u64 indices in the header
_TAG_HOME = struct.Struct("<QQ")
_FP = struct.Struct("<Q")


try:
    from kvhost import _lookup
except ImportError:  # not built: the Python probe below
    _lookup = None

# NATIVE names the C probe's SHA-256 ("sha-ni" or "portable"), or is None
# where the C module is not built and lookups probe in Python.
NATIVE = _lookup.SHA256 if _lookup is not None else None


def loads_ordered(machine):
    """Whether a CPU of machine (platform.machine()'s name) performs the
    Python probe's loads of the table in the order it makes them: x86-64's
    do (its loads are not reordered with one another, and an aligned 8-byte
    load is one access). The probe reads the sequence, then slots, then the
    sequence again, with nothing between them that CPython makes a barrier:
    on a weakly ordered CPU (arm64, POWER, RISC-V) a slot could be read
    while the daemon rewrites it yet between two equal sequences, and a
    stored key be answered absent. The C probe orders its loads itself."""
    return machine.lower() in ("x86_64", "amd64")


# ORDERED_LOADS: the Python probe answers here (a 64-bit Python on x86-64);
# elsewhere it returns None, sending the lookup to the daemon.
ORDERED_LOADS = loads_ordered(platform.machine()) and sys.maxsize > 2**32


class FormatError(ValueError):
    """The file is not a lookup table this client reads."""


def key_hash(fp, key):
    """Returns (tag, home) of key in the namespace with fingerprint fp."""
    tag, home = _TAG_HOME.unpack_from(hashlib.sha256(_FP.pack(fp) + bytes(key)).digest())
    if tag <= 1:
        tag += 2
    return tag, home


class LookupTable:
    """A read-only mapping of the table at path. native=False probes in
    Python even where the C probe is built (tests compare the two)."""

    def __init__(self, path, native=True):
        # The daemon names the path: a FIFO there would block a blocking
        # open until a writer came, and a device is no table either.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(f"{path} is not a regular file: not a lookup table")
            size = st.st_size
            if size < HEADER_SIZE + 8 * MIN_SLOTS:
                raise FormatError(f"{path} is {size} bytes: not a lookup table")
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        magic = self._map[:8]
        version, shift = struct.unpack_from("<II", self._map, 8)
        problem = None
        if magic != MAGIC:
            problem = f"magic {magic!r}"
        elif version != VERSION:
            problem = f"version {version}, this client reads {VERSION}"
        elif shift >= 31 or HEADER_SIZE + (8 << shift) != size:
            problem = f"2^{shift} slots in {size} bytes"
        if problem:
            self._map.close()
            raise FormatError(f"{path}: {problem}")
        view = memoryview(self._map)
        self._header = view[:HEADER_SIZE].cast("Q")
        self._slots = view[HEADER_SIZE:].cast("Q")
        self._mask = (1 << shift) - 1
        self._prefixes = {}  # fp -> sha256 of its 8 bytes, copied per key
        self.native = native and _lookup is not None
        if self.native:
            # The C probe, called with no Python frame between.
            self.leading = functools.partial(_lookup.leading, self._map, shift)
            self.leading_digests = functools.partial(_lookup.leading_digests, self._map, shift)
        elif not ORDERED_LOADS:
            self.leading = self._unordered
            self.leading_digests = self._unordered_digests
        self.path = path

    def leading(self, fp, keys):
        """Returns (n, final): n leading keys are held; final says the next
        key is not stored either. None: the table cannot answer now (the
        daemon closed it or rewrote slots meanwhile), or the Python probe
        cannot on this CPU (ORDERED_LOADS); ask the daemon. The keys'
        number and lengths are checked first, as the daemon checks them
        (ValueError)."""
        check_keys(keys)
        # A copy of the namespace's hashed prefix, updated with the key:
        # 0.7 of the time of hashing prefix + key afresh (CPython's
        # OpenSSL hashes: each new object costs more than a copy).
        base = self._prefixes.get(fp)
        if base is None:
            base = self._prefixes[fp] = hashlib.sha256(_FP.pack(fp))

        def placed():
            for key in keys:
                h = base.copy()
                h.update(key)
                yield _TAG_HOME.unpack_from(h.digest())
        return self._probe(len(keys), placed())

    def digest(self, fp, key):
        """The 16 bytes that place key in the table (the first of
        SHA-256(fp || key)): made once per key and probed, for as long as
        the key is asked about, by leading_digests. The key is checked as
        the daemon checks it (ValueError)."""
        check_keys([key])
        if _lookup is not None:
            return _lookup.digest(fp, key)[:16]
        return hashlib.sha256(_FP.pack(fp) + bytes(key)).digest()[:16]

    def leading_digests(self, digests):
        """leading over keys placed once (digest): digests holds each key's
        16 bytes, key after key (1..4096 keys)."""
        if len(digests) % 16 or not 0 < len(digests) // 16 <= MAX_KEYS:
            raise ValueError(f"{len(digests)} bytes of digests: want 16 per key, 1..{MAX_KEYS} keys")
        n = len(digests) // 16
        return self._probe(n, (_TAG_HOME.unpack_from(digests, 16 * i) for i in range(n)))

    def _probe(self, n, placed):
        """The Python probe of n keys whose (tag, home) placed gives."""
        header, slots, mask = self._header, self._slots, self._mask
        seq = header[_SEQ]
        flags = header[_FLAGS]
        if seq & 1 or flags & FLAG_CLOSED:
            return None
        held = n
        for i, (tag, home) in enumerate(placed):
            if tag <= 1:
                tag += 2
            j = home & mask
            v = slots[j]
            if v != tag:
                probes = 0
                while v != tag and v != 0 and probes <= mask:
                    j = (j + 1) & mask
                    v = slots[j]
                    probes += 1
                if v != tag:
                    held = i
                    break
        if header[_SEQ] != seq:
            return None
        return held, flags & (FLAG_MISSES_FINAL | FLAG_INCOMPLETE) == FLAG_MISSES_FINAL

    def _unordered_digests(self, digests):
        """leading_digests where the Python probe cannot answer: None."""
        return None

    def _unordered(self, fp, keys):
        """leading where the Python probe's loads may be reordered
        (loads_ordered): the keys checked, then None."""
        check_keys(keys)
        return None

    def close(self):
        """Unmaps the table. A probe another thread runs meanwhile raises
        ValueError (the Python probe) or, where the C probe holds the
        mapping (its keys ran Python code that closed the table), reads it
        to its end: the mapping then goes with the last reference to it."""
        self._header.release()
        self._slots.release()
        try:
            self._map.close()
        except BufferError:
            pass
