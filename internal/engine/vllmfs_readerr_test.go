//go:build invariants

package engine

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
)

// TestAVllmFSConfigThatCannotBeReadIsNeverWrittenAnew: the configured
// base directory's config.json holds the configured fields, but reading
// it fails (EIO: a failing disk, a shared mount's server). Open refuses
// the mount with an error wrapping ErrInvalid and the read's error,
// naming the path, and leaves the file as it is: a read error says
// nothing of the bytes, so it is no config.json cut by a crash, to be
// written anew.
func TestAVllmFSConfigThatCannotBeReadIsNeverWrittenAnew(t *testing.T) {
	root := t.TempDir()
	tier := newFSTier(root, 8192)
	tier.init(t)
	config := filepath.Join(tier.base(), "config.json")
	before, err := os.Stat(config)
	if err != nil {
		t.Fatal(err)
	}
	var failed, written atomic.Int32
	files := &fsys.Faulty{FS: fsys.OS{}, Inj: fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		switch {
		case op == fsys.OpRead && path == config:
			failed.Add(1)
			return fsys.Fault{Err: syscall.EIO}
		case op == fsys.OpRename && path == config:
			written.Add(1)
		}
		return fsys.Fault{}
	})}
	e, err := testOpen(context.Background(), Config{FS: files, Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Namespace: tierModel, Fields: tier.fields()}}},
		Policy: newTestPolicy(4, abi.OrderBlockMajor), Logger: testLogger(t), IOWorkers: 2})
	if err == nil {
		e.Close(context.Background())
	}
	if failed.Load() == 0 {
		t.Fatal("config.json was never read")
	}
	if !errors.Is(err, ErrInvalid) || !errors.Is(err, syscall.EIO) || !strings.Contains(err.Error(), config) {
		t.Errorf("Open: %v, want ErrInvalid wrapping EIO, naming %s", err, config)
	}
	after, err := os.Stat(config)
	if err != nil {
		t.Fatal(err)
	}
	if n := written.Load(); n != 0 || !os.SameFile(before, after) {
		t.Errorf("config.json that could not be read was written anew (%d renames over it; same file: %v)", n, os.SameFile(before, after))
	}
}
