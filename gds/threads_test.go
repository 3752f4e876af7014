//go:build linux && cgo

package gds

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

func init() {
	// The main goroutine keeps the main thread, so no other goroutine runs
	// there: one that exits locked on it would park it for good (the
	// runtime never ends the main thread), and threadDevices could not
	// tell that thread from one handed back to the scheduler.
	runtime.LockOSThread()
}

// threadDevices is a Config.BindDevice that records the device it made
// current on each thread, as cudaSetDevice does; a thread it never bound
// has device 0, a fresh thread's.
type threadDevices struct {
	mu  sync.Mutex
	dev map[int]int // tid → current device
}

func newThreadDevices() *threadDevices { return &threadDevices{dev: map[int]int{}} }

func (d *threadDevices) bind(ordinal int) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.dev[unix.Gettid()] = ordinal
	return nil
}

// device is the current device of thread tid.
func (d *threadDevices) device(tid int) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.dev[tid]
}

// liveNotOnZero lists the threads of the process, still alive, whose
// current device is not 0 (as "tid: device").
func (d *threadDevices) liveNotOnZero() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []string
	for tid, dev := range d.dev {
		if dev == 0 {
			continue
		}
		if _, err := os.Stat(fmt.Sprintf("/proc/self/task/%d", tid)); err == nil {
			out = append(out, fmt.Sprintf("%d: device %d", tid, dev))
		}
	}
	sort.Strings(out)
	return out
}

func TestNoThreadOutlivesItsWorkOnAnotherDevice(t *testing.T) {
	for _, tt := range []struct {
		name string
		// work binds threads to device 1 through e's driver and closes
		// what it opened.
		work func(t *testing.T, e *fakeEnv)
	}{
		{"mover workers, per-call I/O", func(t *testing.T, e *fakeEnv) {
			m := newMover(t, e.d, MoverConfig{Workers: 3, AllowCompat: true, IO: IOPerCall})
			dev := newHostDevice(t, 1, 1<<20, 1)
			for i := range 6 {
				f := openFile(t, filepath.Join(t.TempDir(), fmt.Sprint(i)), os.O_RDWR)
				if _, err := m.WriteFile(context.Background(), f, scatterPlan(dev, 16, 4096, uint64(i)), nil); err != nil {
					t.Fatal(err)
				}
			}
			if err := m.Close(); err != nil {
				t.Fatal(err)
			}
		}},
		{"mover workers, batch I/O on two devices", func(t *testing.T, e *fakeEnv) {
			// Each worker ends bound to one device and destroys its batch
			// contexts binding the other ones.
			m := newMover(t, e.d, MoverConfig{Workers: 2, AllowCompat: true, IO: IOBatch, BatchSize: 16})
			dev0, dev1 := newHostDevice(t, 1, 1<<20, 0), newHostDevice(t, 2, 1<<20, 1)
			for i := range 6 {
				dev := []*hostDevice{dev0, dev1}[i%2]
				f := openFile(t, filepath.Join(t.TempDir(), fmt.Sprint(i)), os.O_RDWR)
				if _, err := m.WriteFile(context.Background(), f, sparsePlan(dev, 48, 4096, uint64(i)), nil); err != nil {
					t.Fatal(err)
				}
			}
			if err := m.Close(); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tr := newThreadDevices()
			e := openFake(t, Config{BindDevice: tr.bind}, nil)
			tt.work(t, e)
			var left []string
			defer func() {
				if t.Failed() && len(left) > 0 {
					t.Logf("threads handed back with another device current: %v", left)
				}
			}()
			// A thread bound to device 1 may still be ending: wait for it.
			waitFor(t, "every thread bound to device 1 to end or be bound to device 0 again", func() bool {
				left = tr.liveNotOnZero()
				return len(left) == 0
			})
		})
	}
}

func TestDriverCallsLeaveTheCallersThreadOnItsDevice(t *testing.T) {
	for _, tt := range []struct {
		name string
		call func(t *testing.T, e *fakeEnv, tr *threadDevices)
	}{
		{"Open", func(t *testing.T, e *fakeEnv, tr *threadDevices) {
			openFake(t, Config{BindDevice: tr.bind}, nil)
		}},
		{"Close", func(t *testing.T, e *fakeEnv, tr *threadDevices) {
			if err := e.d.Close(); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tr := newThreadDevices()
			e := openFake(t, Config{BindDevice: tr.bind}, nil)
			// The caller is a goroutine locked to a thread with device 1
			// current (a cuda.Worker's function). The thread ends with the
			// test's goroutine: it is never unlocked.
			runtime.LockOSThread()
			tid := unix.Gettid()
			tr.bind(1)
			tt.call(t, e, tr)
			if got := tr.device(tid); got != 1 {
				t.Fatalf("the calling thread's current device is %d after the call; want 1, as before", got)
			}
		})
	}
}
