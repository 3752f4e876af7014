#!/usr/bin/env python3
"""Summarize scripts/thread-states.c's samples within a Go trace's windows.

  go tool trace -d=parsed run.trace > run.parsed
  thread-states.py windows run.parsed 'engine.(*Engine).loadFile' > load.win
  thread-states.py states samples.txt load.win
  thread-states.py syscalls run.parsed load.win

windows: the wall-clock spans (ns) in which the trace has events whose
stack holds FUNC, split where none came for --gap seconds: one line each,
"start end seconds". The trace's Sync events put its clock on the wall
clock, the one thread-states stamps its samples with.

states: per window, the daemon's threads that were runnable (R) and in
uninterruptible sleep (D) per sample, the share of --cpus CPUs that had
no runnable thread of it, and the sleeping threads' kernel stacks.

syscalls: per window, the thread time goroutines spent in system calls
and cgo calls, by call and by the innermost kvhost frames calling it.
"""
import argparse
import collections
import datetime
import re

TIME = re.compile(r" Time=(\d+)")
WALL = re.compile(r"Wall=(\S+)")
GOID = re.compile(r"GoID=(\d+)")


def wall_ns(stamp):
    base, _, frac = stamp.rstrip("Z").partition(".")
    when = datetime.datetime.fromisoformat(base).replace(tzinfo=datetime.timezone.utc)
    return int(when.timestamp()) * 10**9 + int(frac.ljust(9, "0")[:9])


def events(parsed):
    """Yields (header line, innermost-first function names) per trace event."""
    head, stack = None, []
    with open(parsed) as f:
        for line in f:
            if line.startswith("M="):
                if head is not None:
                    yield head, stack
                head, stack = line, []
            elif line.startswith("\t") and not line.startswith("\t\t") and head is not None:
                stack.append(line.strip().split(" @")[0])
    if head is not None:
        yield head, stack


class Clock:
    """Maps trace times to wall-clock ns through the trace's Sync events."""

    def __init__(self):
        self.syncs = []

    def add(self, head):
        m, w = TIME.search(head), WALL.search(head)
        if m and w:
            self.syncs.append((int(m.group(1)), wall_ns(w.group(1))))

    def wall(self, t):
        base = self.syncs[0]
        for s in self.syncs:
            if s[0] <= t:
                base = s
        return base[1] + t - base[0]


def read_windows(path):
    with open(path) as f:
        return [tuple(int(x) for x in line.split()[:2]) for line in f if line.strip()]


def cmd_windows(args):
    clock, times = Clock(), []
    for head, stack in events(args.parsed):
        if " Sync " in head:
            clock.add(head)
        elif any(args.func in s for s in stack):
            m = TIME.search(head)
            if m:
                times.append(int(m.group(1)))
    if not times:
        raise SystemExit(f"no event's stack holds {args.func}")
    times.sort()
    spans, start, last = [], times[0], times[0]
    for t in times[1:]:
        if t - last > args.gap * 1e9:
            spans.append((start, last))
            start = t
        last = t
    spans.append((start, last))
    for a, b in spans:
        print(clock.wall(a), clock.wall(b), f"{(b - a) / 1e9:.3f}")


def cmd_states(args):
    spans = read_windows(args.windows)
    per = collections.defaultdict(collections.Counter)  # (window, t) -> states
    stacks = [collections.Counter() for _ in spans]
    with open(args.samples) as f:
        for line in f:
            p = line.rstrip("\n").split(" ", 4)
            t = int(p[0])
            for i, (a, b) in enumerate(spans):
                if a <= t <= b:
                    per[(i, t)][p[2]] += 1
                    if p[2] != "R":
                        frames = [x for x in (p[4] if len(p) > 4 else "-").split(";") if x]
                        stacks[i][p[2] + " " + ";".join(frames[: args.frames])] += 1
    for i, (a, b) in enumerate(spans):
        samples = [c for (j, _), c in per.items() if j == i]
        n = len(samples)
        if n == 0:
            print(f"window {i}: no samples")
            continue
        run = sum(c["R"] for c in samples) / n
        unint = sum(c["D"] for c in samples) / n
        idle = sum(max(0, args.cpus - c["R"]) for c in samples) / n / args.cpus
        stalled = sum(1 for c in samples if c["D"] >= args.stall) / n
        print(f"window {i} ({(b - a) / 1e6:.0f} ms, {n} samples): runnable {run:.1f}, "
              f"uninterruptible {unint:.2f}, CPUs without a runnable thread {idle:.0%}, "
              f"samples with {args.stall}+ threads in D {stalled:.0%}")
        for key, count in stacks[i].most_common(args.top):
            print(f"  {count / n:6.2f}  {key}")


def cmd_syscalls(args):
    spans = read_windows(args.windows)
    clock, begun, calls = Clock(), {}, []
    for head, stack in events(args.parsed):
        if " Sync " in head:
            clock.add(head)
            continue
        if "StateTransition" not in head or "GoID=" not in head:
            continue
        g = GOID.search(head).group(1)
        t = int(TIME.search(head).group(1))
        if "Running->Syscall" in head:
            call = next((s for s in stack if "unix." in s or "syscall." in s or "_Cfunc_" in s), stack[0] if stack else "?")
            ours = [s.split("kvhost/kvhost/")[-1] for s in stack if "kvhost/kvhost/" in s and "_Cfunc_" not in s]
            begun[g] = (t, call.split("/")[-1], " < ".join(ours[: args.frames]))
        elif "Syscall->" in head and g in begun:
            t0, call, where = begun.pop(g)
            calls.append((t0, t, call, where))
    calls = [(clock.wall(a), clock.wall(b), c, w) for a, b, c, w in calls]
    for i, (a, b) in enumerate(spans):
        spent, count = collections.Counter(), collections.Counter()
        for s, e, call, where in calls:
            overlap = min(e, b) - max(s, a)
            if overlap > 0:
                spent[(call, where)] += overlap
                count[(call, where)] += 1
        print(f"window {i} ({(b - a) / 1e6:.0f} ms): thread-ms in calls")
        for (call, where), ns in spent.most_common(args.top):
            print(f"  {ns / 1e6:8.1f} ms {count[(call, where)]:6d}x  {call}  {where}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("windows")
    w.add_argument("parsed")
    w.add_argument("func")
    w.add_argument("--gap", type=float, default=0.5)
    s = sub.add_parser("states")
    s.add_argument("samples")
    s.add_argument("windows")
    s.add_argument("--cpus", type=int, default=16)
    s.add_argument("--stall", type=int, default=5)
    s.add_argument("--top", type=int, default=12)
    s.add_argument("--frames", type=int, default=7)
    c = sub.add_parser("syscalls")
    c.add_argument("parsed")
    c.add_argument("windows")
    c.add_argument("--top", type=int, default=14)
    c.add_argument("--frames", type=int, default=3)
    args = ap.parse_args()
    {"windows": cmd_windows, "states": cmd_states, "syscalls": cmd_syscalls}[args.cmd](args)


if __name__ == "__main__":
    main()
