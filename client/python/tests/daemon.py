"""A real kvhost daemon for the Python tests: built once per run from this
checkout (or taken from $KVHOST_BIN), started on a temporary directory and
socket with a TOML configuration, stopped with SIGTERM."""

import atexit
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[3]
_build_lock = threading.Lock()
_built = {}

# The longest path of a Unix socket: sun_path holds 108 bytes, the last a
# NUL (the daemon's server.socket allows as many: config.MaxSocketPath).
MAX_SOCKET_PATH = 107
# The bytes a socket's path may add to socket_dir's directory, as the Go
# tests' testsock.Room.
SOCKET_ROOM = 48


def socket_dir(prefix):
    """A new temporary directory (tempfile.mkdtemp with prefix) whose path
    leaves SOCKET_ROOM bytes for a socket below it: in $TMPDIR where that
    is short enough, else in /tmp. A TMPDIR of 60 bytes or more (CI
    runners often have one) left no room for a socket under it. The caller
    removes it."""
    parent = tempfile.gettempdir()
    if len(parent) + 1 + len(prefix) + 8 + SOCKET_ROOM > MAX_SOCKET_PATH:  # mkdtemp adds 8
        parent = "/tmp"
    return tempfile.mkdtemp(prefix=prefix, dir=parent)


def kvhost_binary():
    """Path of a kvhost binary: $KVHOST_BIN, else `go build` into a temp dir
    removed when the process exits."""
    env = os.environ.get("KVHOST_BIN")
    if env:
        return env
    with _build_lock:
        if "bin" not in _built:
            d = tempfile.mkdtemp(prefix="kvhost-pytest-bin-")
            atexit.register(shutil.rmtree, d, True)
            out = os.path.join(d, "kvhost")
            r = subprocess.run(["go", "build", "-o", out, "./cmd/kvhost"], cwd=REPO,
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"go build ./cmd/kvhost failed:\n{r.stderr}")
            _built["bin"] = out
        return _built["bin"]


def policy_cache():
    """The policy's compilation cache (policy.cache_dir) the daemons of this
    process share, in a temp dir removed when the process exits: the first
    daemon's start compiles the built-in policy, the others read it."""
    with _build_lock:
        if "cache" not in _built:
            d = tempfile.mkdtemp(prefix="kvhost-pytest-wasm-")
            atexit.register(shutil.rmtree, d, True)
            _built["cache"] = d
        return _built["cache"]


class Daemon:
    """kvhost serving dir (a cache root) on a socket in a fresh temp dir;
    server_toml adds lines to its [server] table, policy_toml to its
    [policy] table."""

    def __init__(self, capacity="1GiB", dir=None, extra_toml="", after_toml="", server_toml="", policy_toml=""):
        self.tmp = socket_dir("kvhost-pytest-")
        self.dir = dir or os.path.join(self.tmp, "blocks")
        os.makedirs(self.dir, exist_ok=True)
        self.socket = os.path.join(self.tmp, "kvhost.sock")
        self.config = os.path.join(self.tmp, "kvhost.toml")
        self._toml = dict(capacity=capacity, extra_toml=extra_toml, after_toml=after_toml, server_toml=server_toml,
                          policy_toml=policy_toml)
        self._write_config()
        self.log = open(os.path.join(self.tmp, "kvhost.log"), "w+")
        self._start()

    def _write_config(self):
        t = self._toml
        with open(self.config, "w") as f:
            f.write(f'[server]\nsocket = "{self.socket}"\n{t["server_toml"]}\n\n[log]\nlevel = "warn"\nformat = "json"\n\n'
                    f'[policy]\ncache_dir = "{policy_cache()}"\n{t["policy_toml"]}\n\n'
                    f'{t["extra_toml"]}\n[[mount]]\npath = "{self.dir}"\ncapacity = "{t["capacity"]}"\n'
                    f'{t["after_toml"]}\n')

    def reconfigure(self, dir=None, **toml):
        """Rewrites the configuration (after halt, before start_again): a
        cache root of dir (made if missing), and the other keyword
        arguments of the constructor given replace theirs. The socket
        stays: the next start is a restart with another configuration."""
        unknown = set(toml) - set(self._toml)
        if unknown:
            raise TypeError(f"reconfigure: unknown argument(s) {sorted(unknown)}")
        if dir is not None:
            self.dir = dir
            os.makedirs(self.dir, exist_ok=True)
        self._toml.update(toml)
        self._write_config()

    def _start(self):
        self.proc = subprocess.Popen([kvhost_binary(), "--config", self.config],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline().strip()
        if line != f"kvhost: listening on unix:{self.socket}":
            self.halt()
            logs = self.logs()  # before stop closes the log
            self.stop()
            raise RuntimeError(f"kvhost did not start: {line!r}\n{logs}")

    def freeze(self):
        """Stops the daemon process where it is (SIGSTOP) and returns once
        it is stopped: requests sent to it wait unread until thaw or halt."""
        self.proc.send_signal(signal.SIGSTOP)

        def stopped():
            with open(f"/proc/{self.proc.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
        wait_for(stopped, what="the daemon to stop")

    def thaw(self):
        """Resumes a frozen daemon (SIGCONT)."""
        self.proc.send_signal(signal.SIGCONT)

    def halt(self, sig=signal.SIGTERM):
        """Stops the daemon with sig (SIGKILL: a crash), keeping its
        directory and configuration for start_again. A frozen daemon
        resumes to receive sig."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.send_signal(signal.SIGCONT)
            self.proc.wait(30)
        self.proc.stdout.close()

    def start_again(self):
        """A new daemon process on the same socket, directory and
        configuration (after halt; reconfigure changes the last two): a
        restart, as an upgrade does."""
        self._start()

    def logs(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def data_files(self):
        """Every published file under the cache root (no temporaries)."""
        out = []
        for root, _, files in os.walk(self.dir):
            out += [os.path.join(root, f) for f in files if not f.startswith(".")]
        return sorted(out)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def wait_for(cond, timeout=30.0, what="condition"):
    """Polls cond() until it is truthy; returns its value or raises."""
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


class LogRecords(logging.Handler):
    """Keeps the messages logged to the logger named (until close)."""

    def __init__(self, name):
        super().__init__(logging.DEBUG)
        self.messages = []
        self._logger = logging.getLogger(name)
        self._logger.addHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())

    def has(self, text):
        """Whether a message logged so far contains text."""
        return self.count(text) > 0

    def count(self, text):
        """How many messages logged so far contain text."""
        return sum(text in m for m in list(self.messages))

    def close(self):
        self._logger.removeHandler(self)
        super().close()


class Stopping:
    """A socket where a daemon answers as one that began stopping while the
    client connected, with Error(shutting down) in reply to a request, as
    the real one does in that race: to the Hello (at="hello": it was
    accepted before the stop, admitted after) or, having welcomed the
    client, to its first request (at="request": the engine closed first,
    ErrClosed). Serves every connection so, until closed."""

    def __init__(self, at="hello"):
        import socket
        if at not in ("hello", "request"):
            raise ValueError(at)
        self.at = at
        self.dir = socket_dir("kvhost-stopping-")
        self.socket = os.path.join(self.dir, "kvhost.sock")
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(self.socket)
        self._srv.listen(8)
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True, name="stopping-daemon")
        self._thread.start()

    def _serve(self):
        import struct
        from kvhost import protocol as p
        msg = b"the daemon is shutting down"
        err = struct.pack("<BBH", p.CODES.index("shutting down"), 0, len(msg)) + msg
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return  # closed
            self.connections += 1
            with conn:
                try:
                    f = conn.makefile("rb")
                    n, t, _, rid = p.HEADER.unpack(f.read(p.HEADER_SIZE))
                    f.read(n)
                    if self.at == "request":
                        body = struct.pack("<HH7I", p.VERSION, 0, 1 << 20, 64, 256, 64, 64, 4096, 64) + b"\x04stop"
                        conn.sendall(p.frame(p.T_HELLO | p.T_REPLY, rid, body))
                        n, t, _, rid = p.HEADER.unpack(f.read(p.HEADER_SIZE))
                        f.read(n)
                    conn.sendall(p.frame(p.T_ERROR, rid, err))
                except (OSError, struct.error):
                    pass  # the client went first

    def close(self):
        import socket
        try:
            self._srv.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._srv.close()
        self._thread.join(10)
        shutil.rmtree(self.dir, ignore_errors=True)
