package fsys

import (
	"path/filepath"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/internal/testwait"
)

// TestOpenToLockOfANamedPipeItMayNotWriteDoesNotWait: someone put a
// named pipe at the name of a file to be flocked (another node's lock
// file in the shared cluster directory), one this process may not open
// for writing (EACCES: a daemon not run as root, or root squashed by an
// NFS server). OpenToLock's read-only retry returns at once: a plain
// read-only open of a pipe waits for a writer, holding the caller (a
// cluster tick's lock probe) forever.
func TestOpenToLockOfANamedPipeItMayNotWriteDoesNotWait(t *testing.T) {
	pipe := filepath.Join(t.TempDir(), "b.lock")
	if err := syscall.Mkfifo(pipe, 0o444); err != nil {
		t.Fatal(err)
	}
	// The first open, read-write, is refused as it would be to a user
	// who may not write the pipe; the test may run as root.
	refused := &Counter{Ops: []Op{OpOpen}, Fault: Fault{Err: syscall.EACCES}}
	files := &Faulty{FS: OS{}, Inj: refused}
	testwait.ReturnsDespitePipe(t, "OpenToLock", pipe, func() {
		if f, err := OpenToLock(files, pipe, 0, 0); err == nil {
			f.Close()
		}
	})
	if refused.Count() != 2 || refused.Fired() != 1 {
		t.Fatalf("%d opens, %d refused: want the read-write one refused, then the read-only one", refused.Count(), refused.Fired())
	}
}
