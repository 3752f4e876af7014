//go:build linux && cgo

package gds

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
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
