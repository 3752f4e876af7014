"""Helpers shared by the secondary tier (``tier``, ``_compat``) and the
offloading spec (``spec``, ``spec_compat``, ``spec_worker``): finding
vLLM and checking its classes, the fallback types both use without vLLM,
the daemon key of a vLLM key, the medium events name, the memory
mapping behind an address, and waiting for a daemon job to end
(connecting to the daemon is _connect's).

Importing this module imports nothing of vLLM.
"""

import dataclasses
import hashlib
import importlib.util
import inspect
import logging
import os
import time
import typing

from .. import protocol as p

# A child of vLLM's "vllm" logger, the one vLLM configures.
_log = logging.getLogger("vllm.kvhost")


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM lacks a feature the kvhost tier or spec needs."""


@dataclasses.dataclass
class OffloadingEvent:
    """Fallback of vLLM's OffloadingEvent (used only without vLLM)."""
    keys: list
    medium: object
    removed: bool
    locality: object = None


@dataclasses.dataclass
class RequestOffloadingContext:
    """Fallback of vLLM's RequestOffloadingContext (used only without vLLM)."""


def vllm_installed():
    """Whether a vllm package can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def vllm_version():
    """The installed vLLM's version, "unknown version" when its metadata
    cannot say (a source checkout)."""
    try:
        from importlib import metadata
        return metadata.version("vllm")
    except Exception:  # a source checkout has no metadata: the name stays generic
        return "unknown version"


def has_field(cls, name):
    """Whether cls (a dataclass or any class) takes name as a field or a
    constructor parameter."""
    if dataclasses.is_dataclass(cls):
        return any(f.name == name for f in dataclasses.fields(cls))
    try:
        return name in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


def missing_features(api, classes, members: typing.Mapping = None, fields: typing.Mapping = None):
    """What api (a namespace of vLLM's classes or stand-ins) lacks, in
    order: each of classes that is absent, then each "Class.member" of
    members (class name -> attribute names) and each "Class.field" of fields
    (class name -> constructor fields) of a class that is present."""
    missing = [n for n in classes if getattr(api, n, None) is None]
    for n, names in (members or {}).items():
        c = getattr(api, n, None)
        if c is not None:
            missing += [f"{n}.{m}" for m in names if not hasattr(c, m)]
    for n, names in (fields or {}).items():
        c = getattr(api, n, None)
        if c is not None:
            missing += [f"{n}.{f}" for f in names if not has_field(c, f)]
    return missing


def unsupported(api, missing, window):
    """The UnsupportedVLLM error for an api that lacks missing (names),
    naming the supported window."""
    return UnsupportedVLLM(f"kvhost.vllm: this vLLM ({getattr(api, 'name', '?')}) lacks "
                           f"{', '.join(missing)}; supported: {window}")


def merge_options(given, defaults, ignored, what):
    """defaults (a dict) updated by the entries of given that it names; an
    entry neither in defaults nor in ignored is a ValueError naming every
    such one (what: "tier" or "spec", the kind of option)."""
    unknown = sorted(set(given) - set(defaults) - set(ignored))
    if unknown:
        raise ValueError(f"kvhost.vllm: unknown {what} option(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(defaults))}")
    o = dict(defaults)
    o.update({k: v for k, v in given.items() if k in defaults})
    return o


def check_seconds(o, keys):
    """Raises ValueError naming the first option of keys in o that is not
    a finite number of seconds >= 0 (a bool, a string, NaN or infinity is
    none: a wait of infinite seconds overflows)."""
    for k in keys:
        v = o[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e9:
            raise ValueError(f"kvhost.vllm: {k}: want seconds >= 0 (finite), got {v!r}")


# The default bound on any wait of a vLLM call on the daemon (option
# "daemon_wait_s"): well under vLLM's own limits on a step and a stop
# (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s, on a worker's step;
# VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, 5 s, on the engine core's and the
# workers' exit), and long enough for a healthy daemon's jobs to end.
DAEMON_WAIT_S = 2.0


def check_daemon_wait(o):
    """Raises ValueError unless o's daemon_wait_s is a finite number of
    seconds > 0: the bound on any wait of a vLLM call on the daemon."""
    t = o["daemon_wait_s"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1e9:
        raise ValueError(f"kvhost.vllm: daemon_wait_s: want seconds > 0 (finite), got {t!r}")


def setup_timeout(o):
    """The timeout of a connection's handshake and set-up requests (made
    in a vLLM call at start): request_timeout_s, but no more than
    daemon_wait_s."""
    return min(o["request_timeout_s"], o["daemon_wait_s"])


def daemon_pid(client):
    """The pid of the daemon at the other end of client's socket
    (Client.peer_pid), None where it cannot be read."""
    peer = getattr(client, "peer_pid", None)
    return peer() if callable(peer) else None


def daemon_state(client):
    """For a log line on a daemon that does not answer: its pid and
    whether that process still exists ("daemon pid 123, alive": frozen
    or stuck; "gone": its connection's end follows), as far as known."""
    pid = daemon_pid(client)
    if pid is None:
        return "daemon pid unknown"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"daemon pid {pid}, gone"
    except OSError:  # EPERM: it exists, another user's process
        pass
    return f"daemon pid {pid}, alive"


def check_request_timeout(o):
    """Raises ValueError unless o's request_timeout_s is a finite number of
    seconds > 0, as Client's timeout takes it."""
    t = o["request_timeout_s"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1e9:
        raise ValueError(f"kvhost.vllm: request_timeout_s: want seconds > 0 (finite), got {t!r}")


def daemon_key(key):
    """The daemon's key for a vLLM key (hashed when longer than the
    daemon's maximum key length)."""
    key = bytes(key)
    if len(key) <= p.MAX_KEY_LEN:
        return key
    return b"\xffkvhost-sha256:" + hashlib.sha256(key).digest()


def pick_medium(api, name=None):
    """The medium events name: vLLM's Medium member called name (or the
    first of DISK, STORAGE, FS, FILE that exists), else the plain string
    (name, or "KVHOST"). A name that is not a member is a ValueError."""
    medium = getattr(api, "Medium", None)
    if medium is None:
        return name or "KVHOST"
    for n in [name] if name else ["DISK", "STORAGE", "FS", "FILE"]:
        if hasattr(medium, n):
            return getattr(medium, n)
    if name:
        raise ValueError(f"kvhost.vllm: medium {name!r} is not a member of vLLM's Medium "
                         f"({', '.join(m.name for m in medium)})")
    return "KVHOST"


def mapping_of(addr, length):
    """The /proc/self/maps entry holding [addr, addr+length): (start, end,
    file offset, path); None when no one mapping holds it."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr and addr + length <= hi:
                path = parts[5].strip() if len(parts) > 5 else ""
                return lo, hi, int(parts[2], 16), path
    return None


def open_mapped(lo, hi, path):
    """A read-write descriptor of the file behind the mapping [lo, hi) of
    path (a mapping_of entry): the file itself when it has a path, else (a
    memfd, a deleted file) the mapping through /proc/self/map_files."""
    if path.startswith("/") and not path.endswith("(deleted)"):
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    return os.open(f"/proc/self/map_files/{lo:x}-{hi:x}", os.O_RDWR | os.O_CLOEXEC)


def reason(e):
    """The text kept of an error that ended a connection: never the
    exception itself, whose traceback holds the frames that met it (and
    through them, say, vLLM's region)."""
    return f"{type(e).__name__}: {e}"


def wait_ended(job, timeout, until, what, on_cancel=None):
    """job's result once the daemon has ended it (its error raised, as
    Job.wait raises it): the memory it moves is used again after this, and
    a job still running could touch it. Past timeout (seconds; None: none)
    the daemon is asked once to cancel it (once it accepted it; on_cancel()
    runs if it did cancel), and the job is waited for still, said in the
    log every timeout under what ("tier", "spec: store job 7"). until() is when to
    give up (monotonic; None: never): then TimeoutError."""
    asked = False
    while True:
        step, deadline = timeout, until()
        if deadline is not None:
            left = max(0.0, deadline - time.monotonic())
            step = left if timeout is None else min(timeout, left)
        try:
            return job.wait(step)
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise
            if not asked and job.id is not None:  # a job not yet accepted is asked next time
                asked = True
                try:
                    if job.cancel() and on_cancel is not None:
                        on_cancel()
                except Exception as e:  # the daemon does not answer: keep waiting for the job
                    _log.debug("kvhost %s: cancel: %s", what, e)
            _log.warning("kvhost %s: daemon job %s not done after %gs; waiting for the daemon to end it%s", what,
                         job.id if job.id is not None else "(not yet accepted)", timeout,
                         " (asked to cancel it)" if asked else "")
