#!/usr/bin/env python3
"""Where a kvhost daemon's loads spend their time, from a Go execution
trace of the daemon: each task's and region's durations, as quantiles.

    trace-regions.py TRACE            (runs `go tool trace -d=parsed TRACE`)
    trace-regions.py --parsed FILE    (that command's output, - for stdin)
    trace-regions.py --steps TRACE    (per layer-wise step, when each load
                                      task's files were read: below)

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

With --steps, the load tasks of each layer-wise step (from a task whose
range begins at layer 0 to the next), in ms from the step's first task's
begin: the step's first read's start and the span from there to the end
of its last read (how long the copies took), then per task its begin,
first read's start, last read's end and end:

    step 0 tasks 10 first_read_ms 0.35 reads_ms 84.65
    step 0 task layers [0, 1) begin_ms 0.00 first_read_ms 0.35 last_read_end_ms 5.28 end_ms 5.45 files 126 open16_ms 0.74 read_end_p95_ms 3.40

(files: its reads; open16_ms: its 16th file's open, the default file
slots all taken; read_end_p95_ms: its reads' 95th percentile end, beside
the last read's end.)
"""

import argparse
import collections
import re
import subprocess
import sys

FIRST_READ = "load: read"  # the region whose earliest end is a task's first read

EVENT = re.compile(r'\bG=(-?\d+) (TaskBegin|TaskEnd|RegionBegin|RegionEnd|Log) Time=(\d+) (?:ID|Task)=(\d+)'
                   r'.*?(?:Type|Message)="([^"]*)"')


def events(lines):
    """The task, region and log events of `go tool trace -d=parsed` lines:
    (goroutine, kind, time in ns, task id, type or message)."""
    for line in lines:
        m = EVENT.search(line)
        if m:
            yield m.group(1), m.group(2), int(m.group(3)), m.group(4), m.group(5)


def close_region(stack, name):
    """Takes the innermost open region of type name off a goroutine's
    stack of (type, begin) (regions nest) and returns its begin; None
    where none is open."""
    for i in range(len(stack) - 1, -1, -1):
        if stack[i][0] == name:
            return stack.pop(i)[1]
    return None


def durations(lines):
    """(task durations by type, by (type, logged message), region durations
    by type, and first reads: by type and by (type, message), each task's
    start to the earliest end of its FIRST_READ regions), in nanoseconds, from
    `go tool trace -d=parsed` lines."""
    tasks, logs, first = {}, {}, {}  # task id -> (type, begin); its first log; its first read's end
    by_task, by_log, regions, first_task, first_log = (collections.defaultdict(list) for _ in range(5))
    stacks = collections.defaultdict(list)  # goroutine -> its open regions, (type, begin)
    for g, kind, t, ident, name in events(lines):
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
            begin = close_region(stacks[g], name)
            if begin is not None:
                regions[name].append(t - begin)
            if name == FIRST_READ and ident in tasks:
                first[ident] = min(first.get(ident, t), t)
    return by_task, by_log, regions, first_task, first_log


OPEN = "load: open"  # a file's first region: when its goroutine began on it


def steps(lines):
    """The layer-wise steps of the trace: the load tasks from each one whose
    logged range begins at layer 0 up to the next such (tasks before the
    first are left out: a step the trace cut). Each step a list, in begin
    order, of (logged range, begin, its first FIRST_READ region's begin,
    its last FIRST_READ region's end, end, its OPEN regions' begins, its
    FIRST_READ regions' ends), in nanoseconds, the lists sorted; None
    where a task read nothing, or did not end in the trace."""
    tasks = {}  # task id -> [message, begin, first read, last read end, end, opens, read ends]
    stacks = collections.defaultdict(list)  # goroutine -> its open regions, (type, begin)
    for g, kind, t, ident, name in events(lines):
        if kind == "TaskBegin" and name == "load":
            tasks[ident] = [None, t, None, None, None, [], []]
        elif kind == "Log" and ident in tasks and tasks[ident][0] is None:
            tasks[ident][0] = name
        elif kind == "TaskEnd" and ident in tasks:
            tasks[ident][4] = t
        elif kind == "RegionBegin":
            stacks[g].append((name, t))
        elif kind == "RegionEnd":
            begin = close_region(stacks[g], name)
            task = tasks.get(ident)
            if begin is not None and name == FIRST_READ and task is not None:
                task[2] = begin if task[2] is None else min(task[2], begin)
                task[3] = t if task[3] is None else max(task[3], t)
                task[6].append(t)
            elif begin is not None and name == OPEN and task is not None:
                task[5].append(begin)
    out = []
    for task in sorted(tasks.values(), key=lambda task: task[1]):
        task[5].sort()
        task[6].sort()
        if (task[0] or "").startswith("layers [0,"):
            out.append([])
        if out:
            out[-1].append(tuple(task))
    return out


def report_steps(lines, out=sys.stdout):
    """One line per layer-wise step (its first read's start after its first
    task began; from there to the end of its last read, of any task) and
    one per task, in ms from the step's first task's begin: its begin,
    first read's start, last read's end and end; then how many files it
    read, when its 16th file's open began (the default file slots all
    taken: how fast the job fills them) and the end of its reads' 95th
    percentile (beside the last read's end: how long its stragglers took)."""
    ss = steps(lines)
    ms = lambda ns, t0: "-" if ns is None else f"{(ns - t0) / 1e6:.2f}"
    for k, step in enumerate(ss):
        t0 = step[0][1]
        first = min((t[2] for t in step if t[2] is not None), default=None)
        last = max((t[3] for t in step if t[3] is not None), default=None)
        span = "-" if first is None or last is None else f"{(last - first) / 1e6:.2f}"
        print(f"step {k} tasks {len(step)} first_read_ms {ms(first, t0)} reads_ms {span}", file=out)
        for msg, begin, fr, lr, end, opens, ends in step:
            p95 = ends[min(len(ends) - 1, int(0.95 * len(ends)))] if ends else None
            print(f"step {k} task {msg} begin_ms {ms(begin, t0)} first_read_ms {ms(fr, t0)} "
                  f"last_read_end_ms {ms(lr, t0)} end_ms {ms(end, t0)} files {len(ends)} "
                  f"open16_ms {ms(opens[15] if len(opens) >= 16 else None, t0)} read_end_p95_ms {ms(p95, t0)}",
                  file=out)
    return bool(ss)


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
    ap.add_argument("--steps", action="store_true",
                    help="one line per layer-wise step and per load task of it, in ms from the step's first task")
    a = ap.parse_args(argv)
    show = report_steps if a.steps else report
    if a.parsed:
        found = show(sys.stdin if a.parsed == "-" else open(a.parsed))
    elif a.trace:
        # Streamed: a second of a busy daemon's trace parses to gigabytes.
        with subprocess.Popen(["go", "tool", "trace", "-d=parsed", a.trace], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) as p:
            found = show(p.stdout)
            err = p.stderr.read()
        if p.returncode != 0:
            sys.exit(f"trace-regions: go tool trace -d=parsed {a.trace}: {err.strip()}")
    else:
        ap.error("name a trace, or --parsed FILE")
    if not found:
        sys.exit("trace-regions: no task or region in the trace (taken while no load ran?)")


if __name__ == "__main__":
    main()
