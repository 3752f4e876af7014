#!/usr/bin/env python3
"""Where a kvhost daemon's loads spend their time, from a Go execution
trace of the daemon: each task's and region's durations, as quantiles.

    trace-regions.py TRACE            (runs `go tool trace -d=parsed TRACE`)
    trace-regions.py --parsed FILE    (that command's output, - for stdin)

Take the trace with the metrics listener's profiling on ([metrics]
profiling = true): curl -o trace.out
'http://127.0.0.1:9400/debug/pprof/trace?seconds=3' while loads run, or
`kvhost bench --trace FILE`. Each load job is a task "load" (a
layer-range load logs its range, "layers [F, E)"), its phases regions
("load: pin", "load: turn", "load: file slots", "load: files") and each
file's ("load: open", "load: read", "load: verify"; in the GPU mover's
registered-file path "gpu: enqueue", "gpu: copy wait", "gpu: checksum").
One line per task type, per task type and logged range, and per region
type; a task's line is followed by one of its tasks' first read, from
the task's start to the earliest end of its `load: read` regions (its first file's
bytes in place):

    task load n 120 p50_us 5012 p90_us 11230 p99_us 19506 max_us 19506
    task load first_read n 120 p50_us 402 ...
    task load layers [0, 1) n 12 p50_us 5117 ...
    task load layers [0, 1) first_read n 12 p50_us 380 ...
    region load: read n 15120 p50_us 1190 ...
"""

import argparse
import collections
import re
import subprocess
import sys

FIRST_READ = "load: read"  # the region whose earliest end is a task's first read

EVENT = re.compile(r'\bG=(-?\d+) (TaskBegin|TaskEnd|RegionBegin|RegionEnd|Log) Time=(\d+) (?:ID|Task)=(\d+)'
                   r'.*?(?:Type|Message)="([^"]*)"')


def durations(lines):
    """(task durations by type, by (type, logged message), region durations
    by type, and first reads: by type and by (type, message), each task's
    start to the earliest end of its FIRST_READ regions), in nanoseconds, from
    `go tool trace -d=parsed` lines."""
    tasks, logs, first = {}, {}, {}  # task id -> (type, begin); its first log; its first read's end
    by_task, by_log, regions, first_task, first_log = (collections.defaultdict(list) for _ in range(5))
    stacks = collections.defaultdict(list)  # goroutine -> its open regions, (type, begin)
    for line in lines:
        m = EVENT.search(line)
        if not m:
            continue
        g, kind, t, ident, name = m.group(1), m.group(2), int(m.group(3)), m.group(4), m.group(5)
        if kind == "TaskBegin":
            tasks[ident] = (name, t)
        elif kind == "Log":
            logs.setdefault(ident, name)
        elif kind == "TaskEnd" and ident in tasks:
            typ, begin = tasks.pop(ident)
            by_task[typ].append(t - begin)
            msg = logs.pop(ident, None)
            if msg is not None:
                by_log[(typ, msg)].append(t - begin)
            if ident in first:
                first_task[typ].append(first.pop(ident) - begin)
                if msg is not None:
                    first_log[(typ, msg)].append(first_task[typ][-1])
        elif kind == "RegionBegin":
            stacks[g].append((name, t))
        elif kind == "RegionEnd":
            stack = stacks[g]
            # The innermost open region of that type (regions nest).
            for i in range(len(stack) - 1, -1, -1):
                if stack[i][0] == name:
                    regions[name].append(t - stack[i][1])
                    del stack[i]
                    break
            if name == FIRST_READ and ident in tasks:
                first[ident] = min(first.get(ident, t), t)
    return by_task, by_log, regions, first_task, first_log


def quantiles(ns):
    ns = sorted(ns)
    q = lambda p: ns[min(len(ns) - 1, int(p * len(ns)))] / 1e3
    return f"n {len(ns)} p50_us {q(0.5):.0f} p90_us {q(0.9):.0f} p99_us {q(0.99):.0f} max_us {ns[-1] / 1e3:.0f}"


def report(lines, out=sys.stdout):
    by_task, by_log, regions, first_task, first_log = durations(lines)
    for typ in sorted(by_task):
        print(f"task {typ} {quantiles(by_task[typ])}", file=out)
        if first_task[typ]:
            print(f"task {typ} first_read {quantiles(first_task[typ])}", file=out)
    for (typ, msg) in sorted(by_log, key=lambda k: (k[0], [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", k[1])])):
        print(f"task {typ} {msg} {quantiles(by_log[(typ, msg)])}", file=out)
        if first_log[(typ, msg)]:
            print(f"task {typ} {msg} first_read {quantiles(first_log[(typ, msg)])}", file=out)
    for name in sorted(regions):
        print(f"region {name} {quantiles(regions[name])}", file=out)
    return bool(by_task or regions)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", help="a Go execution trace of the daemon")
    ap.add_argument("--parsed", help="`go tool trace -d=parsed`'s output instead (- for stdin)")
    a = ap.parse_args(argv)
    if a.parsed:
        found = report(sys.stdin if a.parsed == "-" else open(a.parsed))
    elif a.trace:
        # Streamed: a second of a busy daemon's trace parses to gigabytes.
        with subprocess.Popen(["go", "tool", "trace", "-d=parsed", a.trace], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) as p:
            found = report(p.stdout)
            err = p.stderr.read()
        if p.returncode != 0:
            sys.exit(f"trace-regions: go tool trace -d=parsed {a.trace}: {err.strip()}")
    else:
        ap.error("name a trace, or --parsed FILE")
    if not found:
        sys.exit("trace-regions: no task or region in the trace (taken while no load ran?)")


if __name__ == "__main__":
    main()
