package testwait

import (
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

func TestUntilReturnsOnceTheConditionHolds(t *testing.T) {
	var n atomic.Int32
	go func() {
		for range 5 {
			n.Add(1)
		}
	}()
	Until(t, "five increments", 10*time.Second, func() bool { return n.Load() == 5 })
	if n.Load() != 5 {
		t.Fatalf("returned with n = %d", n.Load())
	}
}

// failRecorder records Fatalf instead of stopping the test.
type failRecorder struct {
	testing.TB
	failed string
}

func (f *failRecorder) Helper() {}
func (f *failRecorder) Fatalf(format string, args ...any) {
	f.failed = format
	panic(f)
}

func TestUntilFailsNamingWhatItAwaited(t *testing.T) {
	r := &failRecorder{TB: t}
	func() {
		defer func() {
			if p := recover(); p != r {
				t.Fatalf("recovered %v, want the recorder's stop", p)
			}
		}()
		Until(r, "a condition that never holds", 5*time.Millisecond, func() bool { return false })
	}()
	if r.failed == "" {
		t.Fatal("Until returned without failing")
	}
}

func TestReturnsDespitePipeReturnsOnceFnDoes(t *testing.T) {
	pipe := filepath.Join(t.TempDir(), "pipe")
	if err := syscall.Mkfifo(pipe, 0o644); err != nil {
		t.Fatal(err)
	}
	ran := false
	ReturnsDespitePipe(t, "an open that does not block", pipe, func() {
		f, err := os.OpenFile(pipe, os.O_RDONLY|syscall.O_NONBLOCK, 0)
		if err != nil {
			t.Error(err)
			return
		}
		f.Close()
		ran = true
	})
	if !ran {
		t.Fatal("returned before fn did")
	}
}
