"""The kvhost Python client: connection setup, the default socket, and the
CUDA IPC and shared-file registrations (what goes on the wire, and what a
daemon without GPU support answers)."""

import fcntl
import gc
import os
import struct
import tempfile
import unittest
import warnings
from unittest import mock

import kvhost
from kvhost import protocol as p

from daemon import Daemon

F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 2)


def open_fds():
    return len(os.listdir("/proc/self/fd"))


class FakeStorage:
    def __init__(self, share):
        self._share = share

    def _share_cuda_(self):
        return self._share


class FakeCudaTensor:
    """Stands in for a torch CUDA tensor: only what register_cuda_tensor
    reads (is_cuda, untyped_storage()._share_cuda_())."""

    def __init__(self, share, is_cuda=True):
        self.is_cuda = is_cuda
        self._storage = FakeStorage(share)

    def untyped_storage(self):
        return self._storage


def torch_share(device, handle, size, offset):
    """The 8-tuple torch 2.x's UntypedStorage._share_cuda_() returns."""
    return (device, handle, size, offset, b"refcounter", 0, b"\x00" * 64, True)


def decode_register(body):
    kind, device, size, offset = struct.unpack_from("<B3xIQQ", body)
    return kind, device, size, offset, body[24:88]


class Captured:
    """Replaces Client._call: records requests, answers MemoryRegistered."""

    def __init__(self):
        self.calls = []

    def __call__(self, ftype, body, fds=None):
        self.calls.append((ftype, body, fds))
        return ftype | p.T_REPLY, struct.pack("<IIQ", 7, 0, 0)


def offline_client():
    """A Client object with no connection, whose requests are captured."""
    c = kvhost.Client.__new__(kvhost.Client)
    c._call = Captured()
    return c


class TestConnect(unittest.TestCase):
    def test_failed_connect_closes_its_socket(self):
        # A socket left open is closed by the garbage collector with a
        # ResourceWarning; the client must close it itself.
        before = open_fds()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            for _ in range(20):
                try:
                    kvhost.Client("/nonexistent/kvhost.sock")
                    self.fail("connected to a socket that does not exist")
                except OSError:
                    pass
            gc.collect()
        leaked = [w for w in caught if issubclass(w.category, ResourceWarning)]
        self.assertEqual(leaked, [], "sockets of failed connects left to the garbage collector")
        self.assertEqual(open_fds(), before, "sockets leaked by failed connects")

    def test_default_socket(self):
        cases = [
            ({"KVHOST_SOCKET": "/run/kvhost/kvhost.sock", "XDG_RUNTIME_DIR": "/run/user/7"}, "/run/kvhost/kvhost.sock"),
            ({"XDG_RUNTIME_DIR": "/run/user/7"}, "/run/user/7/kvhost.sock"),
            ({"XDG_CACHE_HOME": "/tmp/xdg", "HOME": "/home/u"}, "/tmp/xdg/kvhost/kvhost.sock"),
            ({"HOME": "/home/u"}, "/home/u/.cache/kvhost/kvhost.sock"),
        ]
        for env, want in cases:
            with self.subTest(env=env), mock.patch.dict(os.environ, env, clear=True):
                self.assertEqual(kvhost.default_socket(), want)

    def test_client_without_path_uses_kvhost_socket(self):
        d = Daemon()
        try:
            with mock.patch.dict(os.environ, {"KVHOST_SOCKET": d.socket}):
                with kvhost.Client(name="env") as c:
                    self.assertEqual(c.stats()["clients"], 1)
        finally:
            d.stop()


class TestRegisterCudaTensor(unittest.TestCase):
    def test_sends_handle_offset_size_and_device(self):
        handle = bytes(range(64))
        cases = [
            ("no CUDA_VISIBLE_DEVICES", None, 1, 1, handle),
            ("translated through CUDA_VISIBLE_DEVICES", "4,6", 1, 6, handle),
            ("torch 2.11 versioned handle", None, 0, 0, b"\x02c" + handle),
            ("torch 2.13 versioned handle", None, 0, 0, b"\x03c" + handle),
        ]
        for name, visible, index, want_dev, torch_handle in cases:
            with self.subTest(name):
                env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
                with mock.patch.dict(os.environ, env, clear=True):
                    c = offline_client()
                    rid = c.register_cuda_tensor(FakeCudaTensor(torch_share(index, torch_handle, 1 << 20, 4096)))
                self.assertEqual(rid, 7)
                ftype, body, fds = c._call.calls[0]
                self.assertEqual(ftype, p.T_REGISTER_MEMORY)
                self.assertFalse(fds)
                self.assertEqual(decode_register(body), (p.MEMORY_CUDA_IPC, want_dev, 1 << 20, 4096, handle))

    def test_explicit_device_wins(self):
        with mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}):
            c = offline_client()
            c.register_cuda_tensor(FakeCudaTensor(torch_share(1, b"\x01" * 64, 4096, 0)), device=3)
        self.assertEqual(decode_register(c._call.calls[0][1])[1], 3)

    def test_refuses_what_it_cannot_register(self):
        cases = [
            ("host tensor", FakeCudaTensor(torch_share(0, b"\x01" * 64, 4096, 0), is_cuda=False), {}),
            ("expandable segment", FakeCudaTensor(torch_share(0, b"\x02e" + b"\x01" * 80, 4096, 0)), {}),
            ("unknown handle version", FakeCudaTensor(torch_share(0, b"\x09c" + b"\x01" * 64, 4096, 0)), {}),
            ("unknown handle layout", FakeCudaTensor(torch_share(0, b"\x01" * 80, 4096, 0)), {}),
            ("empty storage", FakeCudaTensor(torch_share(0, b"\x01" * 64, 0, 0)), {}),
            ("device named by UUID", FakeCudaTensor(torch_share(0, b"\x01" * 64, 4096, 0)),
             {"CUDA_VISIBLE_DEVICES": "GPU-aaaa"}),
            ("device not visible", FakeCudaTensor(torch_share(2, b"\x01" * 64, 4096, 0)),
             {"CUDA_VISIBLE_DEVICES": "0,1"}),
        ]
        for name, tensor, env in cases:
            with self.subTest(name), mock.patch.dict(os.environ, env, clear=True):
                c = offline_client()
                with self.assertRaises(ValueError):
                    c.register_cuda_tensor(tensor)
                self.assertEqual(c._call.calls, [], "sent a request for a refused tensor")

    def test_daemon_without_gpu_answers_unsupported(self):
        d = Daemon()
        try:
            with kvhost.Client(d.socket) as c:
                with self.assertRaises(kvhost.UnsupportedError):
                    c.register_cuda_tensor(FakeCudaTensor(torch_share(0, b"\x01" * 64, 4096, 0)), device=0)
                st = c.stats()
                self.assertEqual((st["regions"], st["devices"]), (0, []))
        finally:
            d.stop()


class TestStats(unittest.TestCase):
    def test_decodes_devices(self):
        body = struct.pack("<16Q", *range(16)) + struct.pack("<I", 1) + struct.pack("<QQQB7x", 10, 5, 1, 1)
        body += struct.pack("<I", 2) + struct.pack("<I4xQQQ", 0, 1, 4096, 1 << 30)
        body += struct.pack("<I4xQQQ", 1, 0, 0, 1 << 30)
        st = p.decode_stats(body)
        self.assertEqual(st["inflight_jobs"], 15)
        self.assertEqual(st["mounts"], [{"capacity": 10, "used": 5, "entries": 1, "direct": True}])
        self.assertEqual(st["devices"], [
            {"ordinal": 0, "regions": 1, "registered": 4096, "limit": 1 << 30},
            {"ordinal": 1, "regions": 0, "registered": 0, "limit": 1 << 30}])


class TestRegisterSharedFile(unittest.TestCase):
    def test_sends_the_fd_without_sealing(self):
        fd = os.memfd_create("shared", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, 8192)
            c = offline_client()
            self.assertEqual(c.register_shared_file(fd, 8192), 7)
            ftype, body, fds = c._call.calls[0]
            self.assertEqual(ftype, p.T_REGISTER_MEMORY)
            self.assertEqual(fds, [fd])
            self.assertEqual(decode_register(body), (p.MEMORY_SHARED, 0, 8192, 0, bytes(64)))
            self.assertEqual(fcntl.fcntl(fd, F_GET_SEALS) & F_SEAL_SHRINK, 0, "the file was sealed")
            os.ftruncate(fd, 0)  # its owner can still shrink it
        finally:
            os.close(fd)

    def test_refuses_empty_size(self):
        with tempfile.TemporaryFile(dir="/dev/shm") as f:
            c = offline_client()
            with self.assertRaises(ValueError):
                c.register_shared_file(f.fileno(), 0)
            self.assertEqual(c._call.calls, [])


if __name__ == "__main__":
    unittest.main()
