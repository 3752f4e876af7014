//go:build linux && cgo

package gds

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/dl"
	"github.com/kvhost/kvhost/region"
)

// fakeCtl mirrors struct fake_ctl in testdata/fakecufile.c.
type fakeCtl struct {
	DriverOpenError     int64
	RegisterError       int64
	RegisterFailDev     int64
	ReadFailAfter       int64
	ReadFailCode        int64
	ReadTruncateAt      int64
	WriteFailAfter      int64
	WriteShort          int64
	NoCompat            int64
	DriverOpens         int64
	DriverCloses        int64
	HandlesRegistered   int64
	HandlesDeregistered int64
	HandlesLive         int64
	BadHandleUses       int64
	BytesRead           int64
	BytesWritten        int64
	Reads               int64
	Writes              int64
	RegisterCalls       int64
	BatchSetupError     int64
	BatchSubmitError    int64
	BatchFailEntry      int64
	BatchFailCode       int64
	BatchShortEntry     int64
	BatchHold           int64
	BatchSetups         int64
	BatchDestroys       int64
	BatchLive           int64
	BatchSubmits        int64
	BatchEntries        int64
	BatchCancels        int64
	BatchPending        int64
	BatchBadUses        int64
	BatchMaxEntries     int64
	BatchInflight       int64
	BatchInflightMax    int64
	BatchCancelIgnored  int64
	CUError             int64
	BatchRelease        int64
	CallsAfterClose     int64
	HandlesLiveAtClose  int64
}

func (c *fakeCtl) set(p *int64, v int64) { atomic.StoreInt64(p, v) }
func (c *fakeCtl) get(p *int64) int64    { return atomic.LoadInt64(p) }

// buildFake compiles testdata/fakecufile.c with `go env CC` into a fresh
// shared library (so every test has its own state) and returns its path.
func buildFake(t *testing.T, defines ...string) string {
	t.Helper()
	out, err := exec.Command("go", "env", "CC").Output()
	cc := strings.Fields(strings.TrimSpace(string(out)))
	if err != nil || len(cc) == 0 {
		cudatest.Unavailable(t, fmt.Sprintf("no C compiler from `go env CC` to build the fake libcufile: %v", err))
	}
	if _, err := exec.LookPath(cc[0]); err != nil {
		cudatest.Unavailable(t, fmt.Sprintf("C compiler %s not found: %v", cc[0], err))
	}
	lib := filepath.Join(t.TempDir(), "libcufile.so.0")
	args := append(cc[1:], "-shared", "-fPIC", "-O1", "-o", lib)
	args = append(args, defines...)
	args = append(args, "testdata/fakecufile.c", "-lpthread")
	if b, err := exec.Command(cc[0], args...).CombinedOutput(); err != nil {
		t.Fatalf("build fake libcufile: %v\n%s", err, b)
	}
	return lib
}

// fakeControl opens the fake library (the same instance gds loads) and
// returns its control block.
func fakeControl(t *testing.T, lib string) *fakeCtl {
	t.Helper()
	l, err := dl.Open(lib)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	p, err := l.Sym("fake_ctl")
	if err != nil {
		t.Fatal(err)
	}
	return (*fakeCtl)(p)
}

// logBuffer collects log output for assertions.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// fakeEnv is a driver over a fresh fake library.
type fakeEnv struct {
	lib  string
	ctl  *fakeCtl
	d    *Driver
	logs *logBuffer
}

func openFake(t *testing.T, cfg Config, setup func(*fakeCtl)) *fakeEnv {
	t.Helper()
	return openFakeBuilt(t, cfg, setup)
}

// openFakeBuilt is openFake over a fake built with extra compiler
// defines (-DFAKE_NO_BATCH).
func openFakeBuilt(t *testing.T, cfg Config, setup func(*fakeCtl), defines ...string) *fakeEnv {
	t.Helper()
	e := &fakeEnv{lib: buildFake(t, defines...), logs: &logBuffer{}}
	e.ctl = fakeControl(t, e.lib)
	if setup != nil {
		setup(e.ctl)
	}
	cfg.LibraryPaths = []string{e.lib}
	cfg.Logger = slog.New(slog.NewTextHandler(e.logs, nil))
	if cfg.NVFSPath == "" {
		cfg.NVFSPath = filepath.Join(t.TempDir(), "no-nvidia-fs")
	}
	d, err := Open(cfg)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	e.d = d
	t.Cleanup(func() { d.Close() })
	return e
}

// hostDevice is host memory posing as device memory: the fake libcufile
// treats device pointers as host pointers. It is mmap'ed, outside the Go
// heap, so C may write it.
type hostDevice struct {
	id      uint64
	mem     []byte
	ordinal int
}

func newHostDevice(t *testing.T, id uint64, size int, ordinal int) *hostDevice {
	t.Helper()
	mem, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	return &hostDevice{id: id, mem: mem, ordinal: ordinal}
}

func (h *hostDevice) ID() uint64        { return h.id }
func (h *hostDevice) Len() int64        { return int64(len(h.mem)) }
func (h *hostDevice) Kind() region.Kind { return region.KindDevice }
func (h *hostDevice) Ordinal() int      { return h.ordinal }
func (h *hostDevice) Ptr() uintptr      { return uintptr(unsafe.Pointer(&h.mem[0])) }

// openFile opens (creates) a file for the mover.
func openFile(t *testing.T, path string, flags int) fsys.File {
	t.Helper()
	f, err := fsys.OS{}.OpenFile(path, flags|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}
