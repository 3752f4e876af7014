//go:build linux && cgo

package gds

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestDriverCloseLeavesNoCallForAfterTheLibraryIsGone: Close releases
// every handle before it closes the cuFile driver and unloads the
// library, and nothing the engine or a transfer does afterwards (release
// a handle it held across Close, forget a file, probe a mount) calls the
// library: after dlclose that call would jump into unmapped code. The
// fake library counts the calls made after cuFileDriverClose and the
// handles still registered when it was called.
func TestDriverCloseLeavesNoCallForAfterTheLibraryIsGone(t *testing.T) {
	for _, tc := range []struct {
		name  string
		after func(t *testing.T, e *fakeEnv, h *handle, dir string)
	}{
		{"a handle held across Close is released", func(t *testing.T, e *fakeEnv, h *handle, _ string) {
			e.d.cache.release(h)
		}},
		{"its file is forgotten", func(t *testing.T, e *fakeEnv, h *handle, _ string) {
			e.d.forget(h.key.FileID)
			e.d.cache.release(h)
		}},
		{"a mount is probed", func(t *testing.T, e *fakeEnv, h *handle, dir string) {
			if _, err := e.d.ProbeDir(dir); !errors.Is(err, errClosed) {
				t.Errorf("ProbeDir after Close: %v, want errClosed", err)
			}
			e.d.cache.release(h)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := openFake(t, Config{}, nil)
			dir := t.TempDir()
			f := openFile(t, filepath.Join(dir, "key"), os.O_RDWR)
			var h *handle
			if err := e.d.onDevice(0, func() (err error) { h, err = fileHandle(e.d, int(f.Fd())); return err }); err != nil {
				t.Fatal(err)
			}
			if err := e.d.Close(); err != nil {
				t.Fatal(err)
			}
			if n := e.ctl.get(&e.ctl.HandlesLiveAtClose); n != 0 {
				t.Errorf("Close closed the driver with %d handles registered", n)
			}
			tc.after(t, e, h, t.TempDir())
			if n := e.ctl.get(&e.ctl.CallsAfterClose); n != 0 {
				t.Errorf("%d cuFile calls after the driver was closed", n)
			}
		})
	}
}

// TestDriverCloseWaitsForAMoverClosingMeanwhile: Driver.Close closes every
// mover and relies on that having waited for its workers. A mover whose
// Close is already under way (waiting for a job held by a batch) answers
// the driver's second Close; that one must wait too, or the driver closes
// and the library is unloaded under the running job.
func TestDriverCloseWaitsForAMoverClosingMeanwhile(t *testing.T) {
	e := openFake(t, Config{}, nil)
	m, err := e.d.NewMover(MoverConfig{Workers: 1, AllowCompat: true, IO: IOBatch, BatchTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	src := newHostDevice(t, 1, 1<<20, 0)
	p := sparsePlan(src, 8, 4096, 1)
	f := openFile(t, filepath.Join(t.TempDir(), "key"), os.O_RDWR)
	c := e.ctl
	c.set(&c.BatchHold, 1) // the batch stays in flight until its timeout
	res := make(chan error, 1)
	go func() {
		_, err := m.WriteFile(context.Background(), f, p, nil)
		res <- err
	}()
	waitFor(t, "the batch's entries pending", func() bool { return c.get(&c.BatchPending) == 8 })
	mclosed := make(chan error, 1)
	go func() { mclosed <- m.Close() }()
	waitFor(t, "Mover.Close under way", func() bool { m.mu.RLock(); defer m.mu.RUnlock(); return m.closed })
	if err := e.d.Close(); err != nil {
		t.Errorf("Driver.Close: %v", err)
	}
	if err := <-res; !errors.Is(err, errBatchTimeout) {
		t.Errorf("the held job's WriteFile = %v, want a batch timeout", err)
	}
	if err := <-mclosed; err != nil {
		t.Errorf("the first Mover.Close = %v", err)
	}
	if n := c.get(&c.CallsAfterClose); n != 0 {
		t.Errorf("%d cuFile calls after cuFileDriverClose: Driver.Close did not wait for the mover's job", n)
	}
}
