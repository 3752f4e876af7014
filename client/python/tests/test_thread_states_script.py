"""scripts/thread-states.c samples a live process's threads until it exits
(even one that nobody has waited for yet), and scripts/thread-states.py
finds a Go trace's windows, counts thread states in them and sums the
goroutines' system-call time, read from inputs whose answers are known."""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

from daemon import REPO

SCRIPT = REPO / "scripts" / "thread-states.py"

# go tool trace -d=parsed output, cut down: one Sync event (trace time 1000
# is wall 2026-11-27T00:00:00.000001Z), two loadFile events 3 s apart (two
# windows), and a pread of 2 ms by goroutine 7 inside the second.
PARSED = textwrap.dedent("""\
    M=-1 P=-1 G=-1 Sync Time=1000 N=1 Trace=1000 Mono=1000 Wall=2026-11-27T00:00:00.000001Z
    M=10 P=1 G=7 StateTransition Time=2000 GoID=7 Runnable->Running Reason=""
    TransitionStack=
    \tgithub.com/kvhost/kvhost/internal/engine.(*Engine).loadFile @ 0x1
    \t\t/src/internal/engine/load.go:1
    M=10 P=1 G=7 StateTransition Time=3000002000 GoID=7 Running->Syscall Reason=""
    TransitionStack=
    \tgolang.org/x/sys/unix.pread @ 0x2
    \t\t/src/unix/zsyscall.go:1
    \tgithub.com/kvhost/kvhost/fsys.(*osFile).ReadAt @ 0x3
    \t\t/src/fsys/os.go:1
    \tgithub.com/kvhost/kvhost/internal/engine.(*Engine).loadFile @ 0x4
    \t\t/src/internal/engine/load.go:2
    M=10 P=1 G=7 StateTransition Time=3002002000 GoID=7 Syscall->Running Reason=""
    M=10 P=1 G=7 StateTransition Time=3004002000 GoID=7 Running->Waiting Reason=""
    TransitionStack=
    \tgithub.com/kvhost/kvhost/internal/engine.(*Engine).loadFile @ 0x5
    \t\t/src/internal/engine/load.go:3
    """)

WALL0 = 1795737600 * 10**9 + 1000  # 2026-11-27T00:00:00.000001Z in ns


def run(*args):
    out = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise AssertionError(out.stderr)
    return out.stdout


class TestThreadStatesScript(unittest.TestCase):
    def setUp(self):
        self.dir = Path(tempfile.mkdtemp(prefix="kvhost-thread-states-"))
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def test_windows_are_the_spans_of_a_functions_events_on_the_wall_clock(self):
        parsed = self.dir / "run.parsed"
        parsed.write_text(PARSED)
        lines = [line.split() for line in run("windows", parsed, "engine.(*Engine).loadFile").splitlines()]
        self.assertEqual(lines, [
            [str(WALL0 + 1000), str(WALL0 + 1000), "0.000"],
            [str(WALL0 + 3000001000), str(WALL0 + 3004001000), "0.004"],
        ])

    def test_syscalls_sums_each_calls_time_inside_a_window_with_its_callers(self):
        parsed = self.dir / "run.parsed"
        parsed.write_text(PARSED)
        win = self.dir / "win"
        win.write_text(f"{WALL0 + 3000001000} {WALL0 + 3004001000}\n")
        out = run("syscalls", parsed, win)
        self.assertIn("window 0 (4 ms)", out)
        row = [line for line in out.splitlines() if "unix.pread" in line]
        self.assertEqual(len(row), 1, out)
        self.assertEqual(row[0].split()[:3], ["2.0", "ms", "1x"])
        self.assertIn("fsys.(*osFile).ReadAt < internal/engine.(*Engine).loadFile", row[0])

    def test_states_counts_runnable_and_sleeping_threads_per_sample(self):
        samples = self.dir / "samples"
        samples.write_text(textwrap.dedent("""\
            100 1 R
            100 2 D - lock_mm_and_find_vma;exc_page_fault;
            100 3 S futex_wait futex_wait;do_futex;
            200 1 R
            200 2 R
            200 3 S futex_wait futex_wait;do_futex;
            900 1 D - vm_mmap_pgoff;ksys_mmap_pgoff;
            """))
        win = self.dir / "win"
        win.write_text("50 250\n")
        out = run("states", samples, win, "--cpus", "4", "--stall", "1")
        first = out.splitlines()[0]
        # Two samples in the window (the one at 900 is outside): 1.5
        # runnable, 0.5 in D, (3 + 2) / 2 / 4 CPUs without a runnable
        # thread, one sample of two with a thread in D.
        self.assertIn("2 samples", first)
        self.assertIn("runnable 1.5, uninterruptible 0.50", first)
        self.assertIn("CPUs without a runnable thread 62%", first)
        self.assertIn("samples with 1+ threads in D 50%", first)
        self.assertIn("1.00  S futex_wait;do_futex", out)
        self.assertIn("0.50  D lock_mm_and_find_vma;exc_page_fault", out)
        self.assertNotIn("vm_mmap_pgoff", out)

    def test_sampler_reads_a_live_process_and_stops_when_it_exits_unwaited(self):
        exe = self.dir / "thread-states"
        subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-o", str(exe),
                        str(REPO / "scripts" / "thread-states.c")], check=True, timeout=120)
        # The child sleeps, then exits; nobody waits for it until the
        # sampler has stopped on its own, so it stays a zombie meanwhile.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
        try:
            out = self.dir / "samples"
            sampler = subprocess.run([str(exe), str(child.pid), str(out), "1000"],
                                     capture_output=True, text=True, timeout=60)
            self.assertEqual(sampler.returncode, 0, sampler.stderr)
        finally:
            child.wait(timeout=60)
        lines = [line.split(" ", 4) for line in out.read_text().splitlines()]
        self.assertTrue(lines, "no samples")
        self.assertTrue(all(line[1].isdigit() and line[2] in "RSD" for line in lines), lines[:5])
        sleeping = [line for line in lines if line[2] == "S"]
        self.assertTrue(sleeping, "the sleeping child was never seen asleep")
        if os.geteuid() == 0:  # kernel stacks need root
            self.assertTrue(any("sleep" in line[4] for line in sleeping), sleeping[:3])


if __name__ == "__main__":
    unittest.main()
