"""Blocking client of the kvhost daemon, safe to share between threads:
the daemon's requests (memory, namespaces and caches, lookups, pins,
store and load jobs, removal streams, stats) over the connection
_connection keeps (its reader thread hands every reply to the thread that
asked and every job completion to its Job).

The types a client hands and takes are errors', geometry's, jobs' and
removals'; this module names them too (kvhost.client.Result, ...).
"""

import logging
import struct
import threading

from . import memory
from . import protocol as p
from ._connection import SOCKET_ENV, _Connection, default_socket  # noqa: F401 (re-exported)
from .errors import ConnectionLost, KvhostError, UnsupportedError, _again, _refusal
from .geometry import Geometry, Layer, Namespace, vllm_fs_fingerprint  # noqa: F401 (re-exported)
from .jobs import Job, Result  # noqa: F401 (re-exported)
from .lookuptable import FormatError, LookupTable
from .memory import seal_shrink
from .removals import Removal, RemovalBatch, RemovalSubscription  # noqa: F401 (re-exported)

_log = logging.getLogger("kvhost")


class PreparedLoad:
    """A load's keys and blocks packed once (Client.prepare_load): body,
    the request's packed keys and blocks; keys, how many."""
    __slots__ = ("body", "keys")

    def __init__(self, body, keys):
        self.body, self.keys = body, keys


def _pin_request(ftype, ns, keys, lease_s, tail=b""):
    """A pin's (frame type, body)."""
    ns = ns.id if isinstance(ns, Namespace) else ns
    ms = int(round(lease_s * 1000))
    if lease_s > 0 and ms == 0:
        ms = 1
    if not 0 <= ms <= p.MAX_LEASE_MS:
        raise ValueError(f"lease {lease_s}s: want 0..{p.MAX_LEASE_MS // 1000}s")
    return ftype, p.pack("<II", (ns, ms), ("namespace", "lease")) + p.keys_body(keys) + tail


def _pin_reply(body, nkeys):
    """(pin id, each key's state) of the reply to a pin of nkeys keys."""
    pin_id, n = struct.unpack_from("<QI", body)
    if n != nkeys:  # a body too short for n: the reader refused it (reply_problem)
        raise p.ProtocolError(f"pin reply for {n} keys to a pin of {nkeys}")
    return pin_id, body[12:12 + n]


class _Sent:
    """A request sent, its reply not waited for yet (_call_later's
    _Later): when it was sent, and whether its reply came."""
    __slots__ = ("_later",)

    def __init__(self, later):
        self._later = later

    @property
    def sent(self):
        """When the request was sent (time.monotonic())."""
        return self._later.sent

    def answered(self):
        """Whether the daemon's reply came (or the connection ended)."""
        return self._later.answered()


class PendingPin(_Sent):
    """A pin sent, its reply not waited for yet (Client.pin_later)."""
    __slots__ = ("_keys",)

    def __init__(self, later, keys):
        super().__init__(later)
        self._keys = keys

    def result(self):
        """(pin id, [bool per key: pinned]), as Client.pin returns, waited
        for up to the connection's timeout; raises what pin would (a pin
        whose reply comes after the TimeoutError is released then)."""
        _, body = self._later.reply()
        pin_id, states = _pin_reply(body, self._keys)
        return pin_id, [s == p.PIN_HELD for s in states]

    def abandon(self):
        """Gives the pin up unwaited: released once its reply comes."""
        self._later.abandon()


class PendingUnpin(_Sent):
    """An unpin sent, its reply not waited for yet (Client.unpin_later)."""
    __slots__ = ()

    def result(self):
        """How many keys the pin held, as Client.unpin returns, waited for
        up to the connection's timeout; raises what unpin would."""
        _, body = self._later.reply()
        return struct.unpack_from("<I", body)[0]


class Client(_Connection):
    """A connection to the kvhost daemon at path (a Unix socket; None means
    default_socket()). timeout (seconds; None: none) bounds each wait on
    the daemon: connecting, the handshake, every reply and every send.
    A listener that takes no connection, or does not answer the handshake,
    within it raises TimeoutError naming the socket."""

    def subscribe_removals(self, namespaces=(), since=None, callback=None, max_batches=256):
        """Subscribes to the removals of namespaces (Namespace objects or
        ids declared on this connection; none: every namespace of the
        daemon) after since: None the first time (the removals from now
        on), then the cursor (epoch, last) of the last batch read, on this
        connection or another. Where the daemon cannot serve since without
        a gap (older than its ring, or of a daemon since restarted) the
        first batch is a resync. Returns a RemovalSubscription; with
        callback, a thread of the subscription's calls it with each batch
        until the subscription ends. A daemon that did not announce the
        feature (supports_removals) raises UnsupportedError, and nothing
        is sent."""
        if not self.supports_removals:
            raise UnsupportedError(p.CODE_UNSUPPORTED, f"removal streams: the daemon "
                                   f"{self.limits.get('server', '')!r} announced none "
                                   f"(protocol version {self.limits.get('version')})")
        if max_batches < 1:
            raise ValueError(f"max_batches {max_batches}: want at least 1")
        epoch, last = since if since is not None else (0, 0)
        ids = [ns.id if isinstance(ns, Namespace) else ns for ns in namespaces]
        body = p.subscribe_removals(epoch, last, ids)
        req_id, pend = self._send(p.T_SUBSCRIBE_REMOVALS, body)
        if not pend.event.wait(self._timeout):
            threading.Thread(target=self._undo_late, args=(pend, p.T_SUBSCRIBE_REMOVALS, self._unsubscribe_late),
                             daemon=True, name=f"kvhost-undo-{req_id}").start()
            raise TimeoutError(f"no reply to request {req_id} after {self._timeout}s")
        if pend.error is not None:
            raise _again(pend.error)
        if pend.ftype != p.T_SUBSCRIBE_REMOVALS | p.T_REPLY:
            raise _refusal(pend.ftype, pend.body, p.T_SUBSCRIBE_REMOVALS)
        sub_id = p.decode_subscribed(pend.body)[0]
        with self._lock:
            sub = self._subs.get(sub_id)
        if sub is None:
            raise ConnectionLost(f"removal subscription {sub_id} lost with the connection")
        with sub._cond:
            sub._max = max_batches
        if callback is not None:
            def deliver():
                while True:
                    try:
                        b = sub.get()
                    except ConnectionLost:
                        return
                    try:
                        callback(b)
                    except Exception:  # the caller's: logged, the stream goes on
                        _log.exception("kvhost: removal callback")
            threading.Thread(target=deliver, daemon=True, name=f"kvhost-removals-{sub_id}").start()
        return sub

    def _unsubscribe_late(self, body):
        sub_id = p.decode_subscribed(body)[0]
        with self._lock:
            self._subs.pop(sub_id, None)
        self._call(p.T_UNSUBSCRIBE_REMOVALS, p.pack("<I", (sub_id,), ("subscription",)))

    # -- operations ----------------------------------------------------------

    def register_memfd(self, fd, size):
        """Registers size bytes of a memfd (sealed against shrinking here if
        not already); returns the region id."""
        seal_shrink(fd)
        _, body = self._call(p.T_REGISTER_MEMORY, p.register_memory(p.MEMORY_MEMFD, size), [fd],
                             undo=self._unregister_late)
        return struct.unpack_from("<I", body)[0]

    def register_buffer(self, buf):
        """Registers a HostBuffer (or anything with fd and size)."""
        return self.register_memfd(buf.fd, buf.size)

    def register_shared_file(self, fd, size):
        """Registers size bytes of a shared-memory file without sealing it:
        a memfd or a file under /dev/shm (such as vLLM's shared CPU region).
        Its owner may still truncate it; a job touching the missing pages
        then fails (code "bad descriptor") and the daemon goes on. Daemons
        that cannot guard their copies raise UnsupportedError. Returns the
        region id."""
        if size <= 0:
            raise ValueError(f"size {size}: want > 0")
        _, body = self._call(p.T_REGISTER_MEMORY, p.register_memory(p.MEMORY_SHARED, size), [fd],
                             undo=self._unregister_late)
        return struct.unpack_from("<I", body)[0]

    def register_cuda(self, device, handle, offset, size):
        """Registers GPU memory by CUDA IPC handle: [offset, offset+size) of
        the allocation handle (64 bytes, cudaIpcGetMemHandle of its base)
        names, on device as the daemon numbers its GPUs. Daemons without GPU
        support raise UnsupportedError; a stale, forged or other device's
        handle raises KvhostError with code "bad IPC handle"."""
        _, body = self._call(p.T_REGISTER_MEMORY, p.register_memory(p.MEMORY_CUDA_IPC, size, device, offset, handle),
                             undo=self._unregister_late)
        return struct.unpack_from("<I", body)[0]

    def register_cuda_tensor(self, tensor, device=None):
        """Registers the GPU memory of a torch CUDA tensor's storage and
        returns the region id. The region is the whole storage: the tensor
        itself starts tensor.storage_offset() * tensor.element_size() bytes
        into it. Keep the tensor alive while the region is registered.

        device is the daemon's ordinal of the tensor's GPU. By default it is
        found by the GPU's UUID, where torch and the daemon both report it
        (whatever CUDA_VISIBLE_DEVICES says in either process), else it is
        the tensor's device index, translated through CUDA_VISIBLE_DEVICES
        when that is a list of integers (the daemon sees every GPU of the
        node). A device given that the daemon knows as another GPU than the
        tensor's is refused with ValueError: where GPUs have peer access the
        daemon could not tell, and would move the bytes over the peer link.
        torch is imported lazily. See cuda_ipc_handle for what torch gives."""
        dev, handle, offset, size = memory.cuda_ipc_handle(tensor)
        uuid = memory.device_uuid(tensor)
        known = {}
        if uuid is not None:
            known = {d["ordinal"]: d["uuid"] for d in self.stats()["devices"] if d.get("uuid")}
        if device is None and known:
            match = [o for o, u in known.items() if u == uuid]
            if not match:
                raise ValueError(f"the tensor's GPU {memory.uuid_text(uuid)} is not one the daemon serves "
                                 f"({', '.join(memory.uuid_text(u) for u in known.values())})")
            device = match[0]
        elif device is None:
            device = memory.daemon_device(dev)
        elif device in known and known[device] != uuid:
            raise ValueError(f"device={device} is {memory.uuid_text(known[device])} to the daemon, "
                             f"but the tensor lives on {memory.uuid_text(uuid)}")
        return self.register_cuda(device, handle, offset, size)

    def _unregister_late(self, body):
        self.unregister_memory(struct.unpack_from("<I", body)[0])

    def _unpin_late(self, body):
        (pin_id,) = struct.unpack_from("<Q", body)
        if pin_id:
            self.unpin(pin_id)

    def unregister_memory(self, region):
        self._call(p.T_UNREGISTER_MEMORY, p.pack("<I", (region,), ("region",)))

    def declare(self, geometry):
        """Declares a namespace; returns a Namespace."""
        _, body = self._call(p.T_DECLARE, p.declare(geometry))
        ns, bpk, fp, kb = struct.unpack_from("<IIQQ", body)
        self._fps[ns] = fp
        return Namespace(ns, bpk, fp, kb, geometry)

    def undeclare(self, ns):
        """Gives up a namespace no registered cache of this connection uses
        and no pin it holds is in (the daemon answers "in use" naming the
        pins: unpin them first).

        Stored data is kept; the daemon forgets the geometry once no
        connection has it declared (closing the connection undeclares all)."""
        ns = ns.id if isinstance(ns, Namespace) else ns
        self._call(p.T_UNDECLARE, p.pack("<I", (ns,), ("namespace",)))
        self._fps.pop(ns, None)  # lookups in it go to the daemon, which refuses them

    def register_cache(self, ns, layers):
        """Registers a paged cache (one Layer per model layer); returns its id."""
        ns = ns.id if isinstance(ns, Namespace) else ns
        _, body = self._call(p.T_REGISTER_CACHE, p.register_cache(ns, layers),
                             undo=lambda b: self.unregister_cache(struct.unpack_from("<I", b)[0]))
        return struct.unpack_from("<I", body)[0]

    def unregister_cache(self, cache):
        self._call(p.T_UNREGISTER_CACHE, p.pack("<I", (cache,), ("cache",)))

    def lookup(self, ns, keys):
        """Returns how many leading keys are stored.

        The keys the daemon's shared lookup table holds are counted from
        this process's own mapping of it, without a round trip; the daemon
        is asked about the rest unless the table's misses are final
        (docs/protocol.md, "Shared lookup table")."""
        ns = ns.id if isinstance(ns, Namespace) else ns
        # The table checks the keys as the daemon would.
        return self._answer(ns, keys, self._probe(ns, lambda table, fp: table.leading(fp, keys)))

    def key_digests(self, ns, keys):
        """The bytes that place keys in the shared lookup table (16 per key,
        key after key), for lookup_digests: a caller that asks about the
        same keys again and again (a scheduler, for a waiting request)
        hashes them once. None where this process cannot read the table
        (then call lookup). The keys are checked as the daemon checks them
        (ValueError)."""
        ns = ns.id if isinstance(ns, Namespace) else ns
        table, fp = self._table_of(ns)
        if table is None:
            return None
        return b"".join(table.digest(fp, k) for k in keys)

    def lookup_digests(self, ns, keys, digests):
        """lookup of keys whose key_digests the caller kept: the same
        answer, without hashing the keys again where the table answers."""
        ns = ns.id if isinstance(ns, Namespace) else ns
        return self._answer(ns, keys, self._probe(ns, lambda table, fp: table.leading_digests(digests)))

    def _answer(self, ns, keys, got):
        """lookup's answer from the table's (n, final), or None where the
        table gave none: the daemon is asked about what the table leaves."""
        if got is None:
            return self._lookup_daemon(ns, p.keys_body(keys))
        n, final = got
        if n == len(keys) or final:
            with self._lookups_lock:
                self._lookups["table"] += 1
            return n
        return n + self._lookup_daemon(ns, p.keys_body(keys[n:]))

    def _table_of(self, ns):
        """(the shared lookup table, ns's fingerprint), or (None, None)
        where this process cannot read the table for ns."""
        table = self._table if self._table is not None else self._open_table()
        fp = self._fps.get(ns)
        if not table or fp is None:
            return None, None
        return table, fp

    def _probe(self, ns, probe):
        """probe(table, fp)'s answer (n, final), or None where the table
        gives none. A frame of its own: the table is not held by a lookup
        that goes on to the daemon, so that a close meanwhile unmaps it."""
        table, fp = self._table_of(ns)
        if table is None:
            return None
        if self._closed is not None:
            raise _again(self._closed)
        try:
            return probe(table, fp)
        except ValueError:
            # close() on another thread unmapped the table under the probe.
            if self._closed is not None:
                raise _again(self._closed) from None
            raise

    def touch(self, ns, keys):
        """Asks the daemon itself about keys, which counts each hit as an
        access for its eviction policy (a lookup answered from the shared
        lookup table is not seen by the daemon); returns how many leading
        keys are stored."""
        ns = ns.id if isinstance(ns, Namespace) else ns
        return self._lookup_daemon(ns, p.keys_body(keys))

    def _lookup_daemon(self, ns, body):
        with self._lookups_lock:
            self._lookups["daemon"] += 1
        _, reply = self._call(p.T_LOOKUP, p.pack("<I", (ns,), ("namespace",)) + body)
        return struct.unpack_from("<I", reply)[0]

    def _open_table(self):
        """Maps the daemon's shared lookup table; False where there is none
        this process can use (an older daemon, none kept, no permission).
        A daemon that does not answer in time raises TimeoutError, and the
        next lookup asks again."""
        table = False
        try:
            _, body = self._call(p.T_LOOKUP_TABLE, b"")
            (n,) = struct.unpack_from("<H", body)
            table = LookupTable(body[2:2 + n].decode())
        except TimeoutError:  # an OSError, but no answer: not "none to use"
            raise
        except (KvhostError, OSError, FormatError, struct.error, UnicodeDecodeError):
            pass
        with self._lock:
            if self._table is None:
                self._table = table
            elif table:
                table.close()
            return self._table

    def lookup_counts(self):
        """How many lookups the shared lookup table answered alone
        ("table") and how many asked the daemon ("daemon")."""
        with self._lookups_lock:
            return dict(self._lookups)

    def delete(self, ns, keys):
        """Deletes keys; returns how many were stored."""
        ns = ns.id if isinstance(ns, Namespace) else ns
        _, body = self._call(p.T_DELETE, p.pack("<I", (ns,), ("namespace",)) + p.keys_body(keys))
        return struct.unpack_from("<I", body)[0]

    def purge(self, model=None, fingerprint=None):
        """Asks the daemon to remove every file of a model's namespaces
        (model: every namespace declared with the id since the daemon
        started) or of one namespace (fingerprint, an int: as stats()
        lists it; also files found on the mounts that no client declared
        since). Files a client pins stay. Returns a dict: "namespaces",
        "files", "keys", "bytes" removed, "pinned" files kept and "left":
        files whose removal failed (no longer served, still on disk until a
        later purge or an eviction removes them; 0 from a daemon that does
        not say). A model or fingerprint the daemon does not know raises
        KvhostError (UnknownNS); a daemon older than purge, KvhostError
        (UnknownType)."""
        _, reply = self._call(p.T_PURGE, p.purge(model, fingerprint))
        r = dict(zip(("namespaces", "files", "keys", "bytes", "pinned"), struct.unpack_from("<5Q", reply)))
        r["left"] = struct.unpack_from("<Q", reply, 40)[0] if len(reply) >= 48 else 0
        return r

    def pin(self, ns, keys, lease_s=0.0):
        """Pins the stored keys of ns: the daemon neither evicts nor deletes
        them until unpin, the lease (seconds; 0: none, at most 24 h) ends or
        this connection closes. Every file is checked as it is pinned.
        Returns (pin id, [bool per key: pinned]); the id is 0 when no key was
        stored."""
        pin_id, states = self._pin(p.T_PIN, ns, keys, lease_s)
        return pin_id, [s == p.PIN_HELD for s in states]

    def pin_loadable(self, ns, keys, lease_s=0.0, group=""):
        """pin for a client whose loads go through other connections' caches
        (a scheduler beside its workers): while no connection of group
        (join_group; "" for any connection) has a cache of ns registered,
        the daemon pins nothing. Returns (pin id, [bool per key: pinned],
        no_cache), no_cache True when no such cache was registered. A daemon
        older than the frame raises KvhostError (UnknownType)."""
        pin_id, states = self._pin(p.T_PIN_LOADABLE, ns, keys, lease_s, p.group_str8(group, True))
        return pin_id, [s == p.PIN_HELD for s in states], any(s == p.PIN_NO_CACHE for s in states)

    def join_group(self, group):
        """Puts this connection's caches in group (str or bytes, 1..64
        bytes), which pin_loadable can name: one engine's workers join its
        group, so that its scheduler's pins count only their caches. Once
        per connection, before any register_cache. A daemon older than the
        frame raises KvhostError (UnknownType)."""
        self._call(p.T_GROUP, p.group_str8(group, False))

    def pin_later(self, ns, keys, lease_s=0.0):
        """pin, sent without waiting for the daemon's reply: a PendingPin
        whose result() is what pin returns (for a caller that need not
        know yet, such as a scheduler pinning what its workers load next:
        the daemon pins in the order it reads, before any later request
        of this connection)."""
        return PendingPin(self._call_later(*_pin_request(p.T_PIN, ns, keys, lease_s), undo=self._unpin_late), len(keys))

    def _pin(self, ftype, ns, keys, lease_s, tail=b""):
        _, body = self._call(*_pin_request(ftype, ns, keys, lease_s, tail), undo=self._unpin_late)
        return _pin_reply(body, len(keys))

    def unpin(self, pin_id):
        """Releases a pin; returns how many keys it held (0 if it was
        released already or its lease ended)."""
        return self.unpin_later(pin_id).result()

    def unpin_later(self, pin_id):
        """unpin, sent without waiting for the daemon's reply: a
        PendingUnpin whose result() is what unpin returns (for a caller
        that need not know, such as a scheduler releasing a step's pins:
        the daemon releases in the order it reads)."""
        return PendingUnpin(self._call_later(p.T_UNPIN, p.pack("<Q", (pin_id,), ("pin",))))

    def store(self, cache, keys, blocks, block=True):
        """Starts storing keys[i] from cache blocks blocks[i]; returns a Job.
        block=False returns as soon as the request is sent, without waiting
        for the daemon to accept it: a refusal is then raised by the Job's
        wait(), and a daemon that stopped answering holds up no caller."""
        return self._job(p.T_STORE, p.transfer(cache, keys, blocks), block, len(keys))

    def load(self, cache, keys, blocks, block=True, layers=None):
        """Starts loading keys[i] into cache blocks blocks[i]; returns a Job
        (block as for store). A block id NO_BLOCK leaves that block of the
        key out (a load that starts or ends inside a key): the daemon
        loads the key's other blocks, still verifying the whole key.

        layers=(first, count) loads only the layers [first, first+count)
        of every key (count 0: every layer, first 0 then): the daemon
        reads, verifies and writes those layers' bytes of the blocks and
        leaves their other layers as they are; the Result's bytes are
        those layers'. A daemon that did not announce it
        (supports_layer_loads) raises UnsupportedError, and nothing is
        sent; a range past the namespace's layers is refused by the daemon
        (KvhostError, code "invalid argument", naming the range)."""
        return self.load_prepared(self.prepare_load(cache, keys, blocks), layers, block)

    def prepare_load(self, cache, keys, blocks):
        """Packs a load of keys into cache blocks once, for load_prepared
        to send for several layer ranges: a layer-wise load sends the same
        keys and blocks once per group of layers, and packing them is most
        of the client's time per job (about 0.1 ms for 126 keys of 16
        blocks). Checks what load checks; raises the same errors."""
        return PreparedLoad(p.transfer(cache, keys, blocks, load=True), len(keys))

    def load_prepared(self, prepared, layers=None, block=True):
        """load of a prepare_load's keys and blocks, as load(..., layers=
        layers) with the same arguments: every layer (layers None), or
        layers=(first, count)."""
        if layers is None:
            return self._job(p.T_LOAD, prepared.body, block, prepared.keys)
        if not self.supports_layer_loads:
            raise UnsupportedError(p.CODE_UNSUPPORTED, f"a load of layers {tuple(layers)}: the daemon "
                                   f"{self.limits.get('server', '')!r} announced no layer-range loads "
                                   f"(protocol version {self.limits.get('version')})")
        return self._job(p.T_LOAD_LAYERS, prepared.body + p.layer_range(layers), block, prepared.keys)

    def cancel(self, job):
        """Asks to cancel a job; True if it was still in flight."""
        _, body = self._call(p.T_CANCEL, p.pack("<Q", (job.id if isinstance(job, Job) else job,), ("job",)))
        return body[0] == 1

    def stats(self):
        """Returns the daemon's counters as a dict: among them "entries"
        and "keys" (files and keys indexed), "mounts", "devices" and
        "namespaces" ({"list": one dict per namespace, the most bytes
        first, with "fingerprint", "model", "declared", "files", "keys"
        and "bytes"; "left_out": how many the daemon did not list}, or
        None from a daemon that predates the section). A reply whose
        counts run past its bytes raises ProtocolError (the connection,
        whose frames are whole, stays usable)."""
        _, body = self._call(p.T_STATS, b"")
        try:
            return p.decode_stats(body)
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise p.ProtocolError(f"Stats reply of {len(body)} bytes not decodable: {e}") from None
