"""scripts/lookup-latency.py (the benchmark of lookups beside loads) runs
against a real daemon and reports both phases, each answered from the
shared lookup table (by the C probe, and where it is built by the Python
probe too) and by the daemon, with the table probe's stand-in; its pacing
(gpu_paged.time_paced) keeps one call per slot, counted on a fake clock."""

import re
import subprocess
import sys
import unittest
from unittest import mock

from daemon import REPO, Daemon
from kvhost import lookuptable

sys.path.insert(0, str(REPO / "scripts"))
import gpu_paged  # noqa: E402

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
        self.assertGreater(float(beside[-1].group(6)), 0, "the loads moved no bytes")


class FakeClock:
    """perf_counter and sleep of a clock that moves only when told: by
    sleep, by a call's own time (spend), and by tick at each reading (a
    busy wait's progress)."""

    def __init__(self, tick=0.0):
        self.now, self.tick = 0.0, tick

    def perf_counter(self):
        self.now += self.tick
        return self.now

    def sleep(self, s):
        self.now += s

    def spend(self, first, then):
        """A call that takes first seconds the first time, then each time."""
        calls = []

        def call():
            self.sleep(then if calls else first)
            calls.append(1)
        return call


class TestPacedCalls(unittest.TestCase):
    """gpu_paged.time_paced, the probe's pacing, on a clock the test moves:
    what the script's "n" and "due" mean, counted, whatever the machine's
    speed (the script's own run only says its lookups were paced)."""

    def test_calls_keep_their_slots_and_a_late_call_skips_the_missed_ones(self):
        k = 1 / 1024  # seconds a binary fraction can hold exactly
        for name, tick, first, then, interval, spin, want in (
                ("paced, sleeping", 0.0, k, k, 4 * k, False, 64),  # due: 256k / 4k
                ("paced, spinning", k / 1024, k, k, 4 * k, True, 64),
                # Slots 1 to 4 missed, then every 4k from 20k: no catching up.
                ("one call late", 0.0, 20 * k, k, 4 * k, False, 1 + 59),
                ("each call late", 0.0, 12 * k, 12 * k, 4 * k, False, 22),  # back to back: 256k / 12k, rounded up
                ("back to back", 0.0, k, k, 0.0, False, 256)):
            with self.subTest(name):
                clock = FakeClock(tick)
                with mock.patch.object(gpu_paged, "time", clock):
                    lat = gpu_paged.time_paced(clock.spend(first, then), 256 * k, interval, spin)
                self.assertEqual(len(lat), want)
                self.assertTrue(all(abs(x - then) <= 4 * tick for x in lat[1:]), lat[:4])


if __name__ == "__main__":
    unittest.main()
