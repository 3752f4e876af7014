"""scripts/peer-llmd.py (the peer's side of docs/performance.md's
comparison) against a stand-in of llm-d's storage_offload module written
here: an engine that moves every block through real files on its own
thread, as llm-d's does, so that the driver's submission, its polling of
get_finished and its byte-for-byte check run as they do on the GPU
machine, on CPU tensors. The stand-in can lose a byte on load or report a
failed store, and the driver must then say ok False."""

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import unittest

from daemon import REPO

try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

STAND_IN = textwrap.dedent('''
    """A stand-in of llm-d's storage_offload: each job on a thread of its
    own writes or reads one file per path, blocks in order, every layer of a
    block together; KVH_FAKE says what to break (corrupt-load, fail-store,
    never-finish)."""
    import os
    import threading

    class StorageOffloadEngine:
        def __init__(self, threads, blocks_per_file, tensors, groups, block_bytes, read_threads, gds, x):
            assert threads > 0 and read_threads >= 0 and gds == "disabled"
            assert groups == [list(range(len(tensors)))] and len(block_bytes) == 1
            self.tensors = tensors
            self.lock, self.finished = threading.Lock(), []
            self.breaks = os.environ.get("KVH_FAKE", "")

        def async_store_gpu_blocks(self, job, _, paths, ids, __):
            return self._start(job, self._store, paths, ids)

        def async_load_gpu_blocks(self, job, _, paths, ids, __):
            return self._start(job, self._load, paths, ids)

        def get_finished(self):
            with self.lock:
                done, self.finished = self.finished, []
            return done

        def _start(self, job, fn, paths, ids):
            if self.breaks == "never-finish":
                return True

            def work():
                ok = all(fn(p, b) for p, b in zip(paths, ids))
                with self.lock:
                    self.finished.append((job, ok))
            threading.Thread(target=work).start()
            return True

        def _store(self, path, blocks):
            if self.breaks == "fail-store":
                return False
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                for b in blocks:
                    for t in self.tensors:
                        f.write(t[b].numpy().tobytes())
            return True

        def _load(self, path, blocks):
            import torch
            if not os.path.exists(path):
                return False
            with open(path, "rb") as f:
                for b in blocks:
                    for t in self.tensors:
                        row = torch.frombuffer(bytearray(f.read(t[b].numel() * 2)), dtype=torch.int16)
                        t[b].copy_(row)
            if self.breaks == "corrupt-load":
                self.tensors[5][blocks[0], 7] += 1
            return True
''')

ROUND = re.compile(r"llmd (store|load) GB/s (\d+\.\d\d) files (\d+) round (\d) ok (True|False)(?: layers_differ (\d+))?")


@unittest.skipUnless(HAVE_TORCH, "needs torch (python3-torch)")
class TestPeerLlmdScript(unittest.TestCase):
    def driver(self, breaks, *args):
        """Runs the driver on 1/16 GiB, 4 threads, 2 rounds; returns its
        result and the files it left."""
        with tempfile.TemporaryDirectory() as mod, tempfile.TemporaryDirectory() as data:
            with open(os.path.join(mod, "storage_offload.py"), "w") as f:
                f.write(STAND_IN)
            env = dict(os.environ, PYTHONPATH=mod, KVH_FAKE=breaks)
            out = subprocess.run([sys.executable, str(REPO / "scripts" / "peer-llmd.py"), data,
                                  "0.0625", "4", "2", "--device", "cpu", *args],
                                 capture_output=True, text=True, timeout=300, env=env)
            return out, os.listdir(data)

    def run_driver(self, breaks):
        out, left = self.driver(breaks)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(left, [], "the driver left its files behind")
        rounds = [ROUND.fullmatch(line) for line in out.stdout.splitlines() if line.startswith("llmd ")]
        self.assertEqual(len(rounds), 4, out.stdout)
        self.assertTrue(all(rounds), out.stdout)
        return out.stdout, rounds

    def test_says_ok_only_where_the_engine_moved_every_byte(self):
        cases = [  # what the stand-in breaks, store ok, load ok, layers that differ
            ("", "True", "True", "0"),
            ("corrupt-load", "True", "False", "1"),
            ("fail-store", "False", "False", "32"),
        ]
        for breaks, store_ok, load_ok, differ in cases:
            with self.subTest(breaks or "nothing"):
                out, rounds = self.run_driver(breaks)
                for m, (kind, ok) in zip(rounds, [("store", store_ok), ("load", load_ok)] * 2):
                    self.assertEqual((m.group(1), m.group(5)), (kind, ok), out)
                    self.assertEqual(m.group(3), "2", out)  # 1/16 GiB: two files of 32 MiB
                    self.assertGreater(float(m.group(2)), 0, out)
                for m in rounds[1::2]:
                    self.assertEqual(m.group(6), differ, out)

    def test_a_job_the_engine_never_finishes_fails_the_run(self):
        out, _ = self.driver("never-finish", "--job-timeout", "0.5")
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn("peer-llmd: job 1 (2 files) not finished after 0.5 s", out.stderr)
        self.assertNotIn("llmd ", out.stdout)


if __name__ == "__main__":
    unittest.main()
