//go:build linux

package staging

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// startAffinity is the CPU set the test binary started with, read during
// package initialization, before any worker pinned a thread.
var startAffinity = func() unix.CPUSet {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		set.Zero()
	}
	return set
}()

// threadsOffStartAffinity lists the threads of the process whose CPU set
// is not startAffinity (as "tid: cpus"), from /proc/self/task.
func threadsOffStartAffinity(t *testing.T) []string {
	t.Helper()
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	var off []string
	for _, task := range tasks {
		tid, err := strconv.Atoi(task.Name())
		if err != nil {
			continue
		}
		var set unix.CPUSet
		if err := unix.SchedGetaffinity(tid, &set); errors.Is(err, unix.ESRCH) {
			continue // the thread ended meanwhile
		} else if err != nil {
			t.Fatalf("sched_getaffinity(%d): %v", tid, err)
		}
		if set != startAffinity {
			off = append(off, fmt.Sprintf("%d: %s", tid, cpuList(set)))
		}
	}
	return off
}

// cpuList writes a CPU set as the CPUs it holds.
func cpuList(set unix.CPUSet) string {
	var cpus []int
	for c := range len(set) * 64 {
		if set.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	return fmt.Sprint(cpus)
}

func TestPoolHandsNoPinnedThreadBackAfterClose(t *testing.T) {
	if startAffinity.Count() < 2 {
		t.Skipf("the process may run on %d CPU(s): a thread pinned to one looks like the others", startAffinity.Count())
	}
	pin, bad := -1, -1 // a CPU the process may use, and one it may not
	for c := range len(startAffinity) * 64 {
		switch {
		case startAffinity.IsSet(c) && pin < 0:
			pin = c
		case !startAffinity.IsSet(c):
			bad = c
		}
	}
	if bad < 0 {
		t.Skip("the process may use every CPU a CPU set can name: no pinning can fail")
	}
	const workers = 8
	for _, tt := range []struct {
		name string
		cpus []int
		fail bool // newPool fails (after pinning the workers it could)
	}{
		{name: "pool closed", cpus: []int{pin}},
		{name: "pool whose pinning failed", cpus: []int{pin, bad}, fail: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if off := threadsOffStartAffinity(t); len(off) > 0 {
				t.Fatalf("before newPool, threads already off the start affinity %s: %v", cpuList(startAffinity), off)
			}
			p, err := newPool(Config{Workers: workers, CPUs: tt.cpus})
			if tt.fail {
				if err == nil {
					p.close()
					t.Fatalf("newPool pinning to %v succeeded; want a failure", tt.cpus)
				}
			} else {
				if err != nil {
					t.Fatal(err)
				}
				// The check below sees pinned threads: every worker's is.
				if off := threadsOffStartAffinity(t); len(off) < workers {
					t.Fatalf("%d threads pinned while the pool is open; want at least %d: %v", len(off), workers, off)
				}
				p.close()
			}
			if off := threadsOffStartAffinity(t); len(off) > 0 {
				t.Fatalf("after the pool closed, %d threads are not on the start affinity %s: %v", len(off), cpuList(startAffinity), off)
			}
		})
	}
}
