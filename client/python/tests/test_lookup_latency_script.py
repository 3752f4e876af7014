"""scripts/lookup-latency.py (the benchmark of lookups beside loads) runs
against a real daemon and reports both phases, each answered from the
shared lookup table (by the C probe, and where it is built by the Python
probe too) and by the daemon, with the table probe's stand-in."""

import re
import subprocess
import sys
import unittest

from daemon import REPO, Daemon
from kvhost import lookuptable

LINE = r"p50 (\d+) p99 (\d+) max (\d+) n (\d+) due (\d+)"


class TestLookupLatencyScript(unittest.TestCase):
    def test_reports_lookups_alone_and_beside_loads_that_moved_bytes(self):
        for pace in ("sleep", "spin"):  # how the probe waits between lookups
            with self.subTest(pace):
                self.check_run(pace)

    def check_run(self, pace):
        d = Daemon(capacity="512MiB")
        try:
            out = subprocess.run([sys.executable, str(REPO / "scripts" / "lookup-latency.py"), d.socket,
                                  "0.3", "1", "5", "2", pace],
                                 capture_output=True, text=True, timeout=300)
        finally:
            d.stop()
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = out.stdout.splitlines()
        # The table probe's process times its stand-in next; with the C
        # probe built (make test-python builds it), each phase also runs
        # through the Python probe (where it answers: x86-64).
        vias = ("table", "stand-in") + (("table-python",) if lookuptable.NATIVE and lookuptable.ORDERED_LOADS
                                         else ()) + ("daemon",)
        self.assertEqual(len(lines), 2 * len(vias), out.stdout)
        alone = [re.fullmatch(f"alone {via} " + LINE, line) for via, line in zip(vias, lines)]
        beside = [re.fullmatch(f"beside loads {via} " + LINE, line) for via, line in zip(vias[:-1], lines[len(vias):])]
        beside.append(re.fullmatch(r"beside loads daemon " + LINE + r" GB/s (\d+\.\d)", lines[-1]))
        for m, line in zip(alone + beside, lines):
            self.assertIsNotNone(m, line)
        for m in alone + beside:
            p50, p99, mx, n, due = (int(g) for g in m.groups()[:5])
            self.assertEqual(due, 60, m.group(0))  # 0.3 s, one every 5 ms
            self.assertTrue(0 < n <= due + 1, m.group(0))  # paced, not back to back
            self.assertTrue(0 < p50 <= p99 <= mx, m.group(0))
        for m in alone:
            self.assertGreater(int(m.group(4)), 30, "alone, the probe kept less than half its pace")
        self.assertGreater(float(beside[-1].group(6)), 0, "the loads moved no bytes")


if __name__ == "__main__":
    unittest.main()
