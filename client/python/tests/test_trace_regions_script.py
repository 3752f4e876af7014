"""scripts/trace-regions.py: the tasks' and regions' durations of a Go
execution trace, from `go tool trace -d=parsed` lines (a canned text, and
a trace of a real daemon's load)."""

import importlib.util
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

from daemon import REPO, Daemon

spec = importlib.util.spec_from_file_location("trace_regions", REPO / "scripts" / "trace-regions.py")
tr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tr)

# Two load tasks, one with a logged range; a region nested in another on
# goroutine 7, and one left open; a region on goroutine 9 ending after
# goroutine 7's began.
PARSED = """\
M=1 P=0 G=7 TaskBegin Time=1000 ID=1 Parent=18446744073709551615 Type="load"
M=1 P=0 G=7 Log Time=1100 Task=1 Category="layers" Message="layers [0, 1)"
M=1 P=0 G=7 RegionBegin Time=2000 Task=1 Type="load: read"
M=2 P=1 G=9 RegionBegin Time=2500 Task=1 Type="load: read"
M=1 P=0 G=7 RegionBegin Time=3000 Task=1 Type="gpu: copy wait"
M=1 P=0 G=7 RegionEnd Time=7000 Task=1 Type="gpu: copy wait"
M=1 P=0 G=7 RegionEnd Time=12000 Task=1 Type="load: read"
M=2 P=1 G=9 RegionEnd Time=4500 Task=1 Type="load: read"
M=1 P=0 G=7 TaskEnd Time=21000 ID=1 Parent=18446744073709551615 Type="load"
M=1 P=0 G=7 TaskBegin Time=30000 ID=2 Parent=18446744073709551615 Type="load"
M=1 P=0 G=7 RegionBegin Time=31000 Task=2 Type="load: open"
M=1 P=0 G=7 TaskEnd Time=70000 ID=2 Parent=18446744073709551615 Type="load"
"""


class TestTraceRegions(unittest.TestCase):
    def test_tasks_ranges_and_regions_get_their_durations(self):
        out = io.StringIO()
        self.assertTrue(tr.report(PARSED.splitlines(), out))
        self.assertEqual(out.getvalue().splitlines(), [
            "task load n 2 p50_us 40 p90_us 40 p99_us 40 max_us 40",
            # Task 1's first read ended at 4,500 ns (goroutine 9's): 3.5 µs after its start.
            "task load first_read n 1 p50_us 4 p90_us 4 p99_us 4 max_us 4",
            "task load layers [0, 1) n 1 p50_us 20 p90_us 20 p99_us 20 max_us 20",
            "task load layers [0, 1) first_read n 1 p50_us 4 p90_us 4 p99_us 4 max_us 4",
            "region gpu: copy wait n 1 p50_us 4 p90_us 4 p99_us 4 max_us 4",
            "region load: read n 2 p50_us 10 p90_us 10 p99_us 10 max_us 10",
        ])

    def test_lines_without_tasks_or_regions_report_nothing(self):
        self.assertFalse(tr.report(["M=1 P=0 G=7 GoStart Time=5 G=8"], io.StringIO()))

    @unittest.skipUnless(shutil.which("go"), "needs the go command (go tool trace)")
    def test_a_trace_of_a_daemons_load_has_its_task_and_phases(self):
        # A daemon with its profiling endpoint, a store and a load while
        # its execution trace is taken.
        import kvhost
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            addr = f"127.0.0.1:{sk.getsockname()[1]}"
        d = Daemon(capacity="64MiB", extra_toml=f'[metrics]\nlisten = "{addr}"\nprofiling = true\n')
        self.addCleanup(d.stop)
        g = kvhost.Geometry(model="test/trace", layers=2, kv_heads=1, head_size=64, dtype_size=2,
                            tokens_per_block=16, tokens_per_key=16)
        page = 2 * g.block_bytes  # a block's K and V planes in one layer
        with kvhost.Client(d.socket) as c, kvhost.HostBuffer(2 * 4 * page) as buf:
            ns = c.declare(g)
            region = c.register_buffer(buf)
            cache = c.register_cache(ns.id, [kvhost.Layer(region, offset=l * 4 * page, block_stride=page,
                                                          plane_stride=g.block_bytes, num_blocks=4) for l in range(2)])
            self.assertEqual(c.store(cache, [b"k"], [[0]]).wait(30).outcomes(), ["stored"])
            tmp = tempfile.mkdtemp()
            self.addCleanup(shutil.rmtree, tmp, True)
            path = os.path.join(tmp, "trace.out")
            got = {}

            def take():
                got["trace"] = urllib.request.urlopen(f"http://{addr}/debug/pprof/trace?seconds=1", timeout=30).read()
            t = threading.Thread(target=take)
            t.start()
            # Loads for the whole second the trace runs (which starts a
            # little after the request).
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                self.assertEqual(c.load(cache, [b"k"], [[1]]).wait(30).outcomes(), ["loaded"])
            t.join(30)
            with open(path, "wb") as f:
                f.write(got["trace"])
        out = subprocess.run([sys.executable, str(REPO / "scripts" / "trace-regions.py"), path],
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        names = {" ".join(line.split(" n ")[0].split()[1:]) for line in out.stdout.splitlines()}
        for want in ("load", "load: pin", "load: files", "load: open", "load: read", "load: verify"):
            self.assertIn(want, names, out.stdout)
