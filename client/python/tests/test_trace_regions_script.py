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


# Layer-wise steps: a task the trace cut (layers [1, 2), before any step's
# first), then one step of two tasks, each with reads on two goroutines,
# the second task begun before the first's reads; then a step whose one
# task read nothing.
STEPS = """\
M=1 P=0 G=3 TaskBegin Time=500 ID=9 Parent=18446744073709551615 Type="load"
M=1 P=0 G=3 Log Time=510 Task=9 Category="layers" Message="layers [1, 2)"
M=1 P=0 G=7 TaskBegin Time=1000000 ID=1 Parent=18446744073709551615 Type="load"
M=1 P=0 G=7 Log Time=1000100 Task=1 Category="layers" Message="layers [0, 1)"
M=1 P=0 G=8 TaskBegin Time=1200000 ID=2 Parent=18446744073709551615 Type="load"
M=1 P=0 G=8 Log Time=1200100 Task=2 Category="layers" Message="layers [1, 2)"
M=1 P=0 G=7 RegionBegin Time=1500000 Task=1 Type="load: read"
M=2 P=1 G=9 RegionBegin Time=1400000 Task=1 Type="load: read"
M=1 P=0 G=7 RegionEnd Time=3000000 Task=1 Type="load: read"
M=2 P=1 G=9 RegionEnd Time=2500000 Task=1 Type="load: read"
M=1 P=0 G=7 TaskEnd Time=3100000 ID=1 Parent=18446744073709551615 Type="load"
M=1 P=0 G=8 RegionBegin Time=3000000 Task=2 Type="load: read"
M=1 P=0 G=8 RegionEnd Time=6000000 Task=2 Type="load: read"
M=1 P=0 G=8 TaskEnd Time=6500000 ID=2 Parent=18446744073709551615 Type="load"
M=1 P=0 G=7 TaskBegin Time=9000000 ID=3 Parent=18446744073709551615 Type="load"
M=1 P=0 G=7 Log Time=9000100 Task=3 Category="layers" Message="layers [0, 2)"
"""


class TestTraceRegions(unittest.TestCase):
    def test_steps_begin_at_layer_0_and_time_their_reads_from_their_first_task(self):
        out = io.StringIO()
        self.assertTrue(tr.report_steps(STEPS.splitlines(), out))
        self.assertEqual(out.getvalue().splitlines(), [
            # First read began 0.4 ms after the step (goroutine 9's), the last ended at 6 ms.
            "step 0 tasks 2 first_read_ms 0.40 reads_ms 4.60",
            "step 0 task layers [0, 1) begin_ms 0.00 first_read_ms 0.40 last_read_end_ms 2.00 end_ms 2.10 "
            "files 2 open16_ms - read_end_p95_ms 2.00",
            "step 0 task layers [1, 2) begin_ms 0.20 first_read_ms 2.00 last_read_end_ms 5.00 end_ms 5.50 "
            "files 1 open16_ms - read_end_p95_ms 5.00",
            "step 1 tasks 1 first_read_ms - reads_ms -",
            "step 1 task layers [0, 2) begin_ms 0.00 first_read_ms - last_read_end_ms - end_ms - "
            "files 0 open16_ms - read_end_p95_ms -",
        ])

    def test_a_tasks_line_says_when_its_16th_file_opened_and_how_late_its_stragglers_ended(self):
        # One task of 60 files, file i opened at 100 + 10 i us and read
        # from there to 1 ms + 50 i us, but the last two ended at 9 and
        # 10 ms: the 16th opened at 0.25 ms, the 58th read (the 95th
        # percentile's) ended at 3.85 ms.
        lines = ['M=1 P=0 G=1 TaskBegin Time=0 ID=1 Parent=18446744073709551615 Type="load"',
                 'M=1 P=0 G=1 Log Time=10 Task=1 Category="layers" Message="layers [0, 1)"']
        for i in range(60):
            g, opened = 100 + i, 100_000 + 10_000 * i
            end = {58: 9_000_000, 59: 10_000_000}.get(i, 1_000_000 + 50_000 * i)
            lines += [f'M=1 P=0 G={g} RegionBegin Time={opened} Task=1 Type="load: open"',
                      f'M=1 P=0 G={g} RegionEnd Time={opened + 5_000} Task=1 Type="load: open"',
                      f'M=1 P=0 G={g} RegionBegin Time={opened + 6_000} Task=1 Type="load: read"',
                      f'M=1 P=0 G={g} RegionEnd Time={end} Task=1 Type="load: read"']
        lines.append('M=1 P=0 G=1 TaskEnd Time=10100000 ID=1 Parent=18446744073709551615 Type="load"')
        out = io.StringIO()
        self.assertTrue(tr.report_steps(lines, out))
        self.assertEqual(out.getvalue().splitlines()[1],
                         "step 0 task layers [0, 1) begin_ms 0.00 first_read_ms 0.11 last_read_end_ms 10.00 "
                         "end_ms 10.10 files 60 open16_ms 0.25 read_end_p95_ms 3.85")

    def test_a_trace_without_a_step_from_layer_0_reports_none(self):
        self.assertFalse(tr.report_steps(PARSED.splitlines()[9:], io.StringIO()))

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
