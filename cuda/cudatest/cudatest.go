// Package cudatest builds a fake CUDA runtime and driver library for CPU
// tests of code that uses package cuda: "device memory" is host memory,
// copies are memcpy run when their stream is synchronized, IPC handles
// name live allocations of the same process, and faults can be injected.
// The library is compiled from C at test time with `go env CC`, so the
// real dlopen path runs on machines without a GPU.
package cudatest

import (
	_ "embed"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

//go:embed testdata/fakecuda.c
var source []byte

// Op is a kind of operation the fake counts and can fail.
type Op int

// Operations.
const (
	OpCopy         Op = iota // one copy enqueued (per segment, batched or not)
	OpSync                   // a stream or event synchronization
	OpIPCOpen                // cudaIpcOpenMemHandle
	OpHostAlloc              // cudaHostAlloc
	OpHostRegister           // cudaHostRegister
	OpBatch                  // a cudaMemcpyBatchAsync call
	_                        // (per-segment copy calls, counted in C only)
	OpRecord                 // a cudaEventRecord
	OpLaunch                 // a cuLaunchKernel (of the copy kernel)
	OpModuleLoad             // a cuModuleLoadDataEx (the copy kernel's PTX)
	OpModuleUnload           // a cuModuleUnload
	OpQuery                  // a cudaEventQuery
	OpAddressRange           // a cuMemGetAddressRange (of an imported IPC allocation)
	OpIPCClose               // cudaIpcCloseMemHandle (counted; its fault is ignored)
	OpUnregister             // cudaHostUnregister
)

var (
	buildOnce sync.Once
	built     []byte // the compiled library
	buildErr  string
)

// RequireEnv names the environment variable that makes a fake library
// that cannot be built fail the test instead of skipping it: `make test`
// (and so CI) sets it, so that the tests of the real dlopen path cannot
// silently stop running.
const RequireEnv = "KVHOST_REQUIRE_FAKES"

// Unavailable skips t because a fake library cannot be built or loaded
// here (why), or fails it where RequireEnv is set.
func Unavailable(t testing.TB, why string) {
	t.Helper()
	if os.Getenv(RequireEnv) != "" {
		t.Fatalf("%s (%s is set: the fake libraries are required)", why, RequireEnv)
	}
	t.Skip(why)
}

// Build returns the path of a fresh copy of the fake library in a
// directory of t's that goes with t, for both cuda.Config.Runtime and
// cuda.Config.Driver: the fake's state (counts, faults) is the copy's
// own, shared by whatever the test loads from that path (pass the same
// path to Open). The library is compiled once per test binary, in a
// temporary directory removed at once: a test run leaves nothing behind.
// It skips the test when no C compiler or cgo is available.
func Build(t testing.TB) string {
	t.Helper()
	if !supported {
		Unavailable(t, "cudatest: needs cgo on Linux to load the fake CUDA library")
	}
	buildOnce.Do(func() { built, buildErr = compile() })
	if built == nil {
		Unavailable(t, "cudatest: "+buildErr)
	}
	lib := filepath.Join(t.TempDir(), "libfakecuda.so")
	if err := os.WriteFile(lib, built, 0o755); err != nil {
		t.Fatalf("cudatest: %v", err)
	}
	return lib
}

// compile builds the fake library with `go env CC` and returns its bytes,
// or why it could not.
func compile() ([]byte, string) {
	cc := "cc"
	if out, err := exec.Command("go", "env", "CC").Output(); err == nil && strings.TrimSpace(string(out)) != "" {
		cc = strings.Fields(string(out))[0]
	}
	if _, err := exec.LookPath(cc); err != nil {
		return nil, "no C compiler: " + err.Error()
	}
	dir, err := os.MkdirTemp("", "kvhost-fakecuda")
	if err != nil {
		return nil, err.Error()
	}
	defer os.RemoveAll(dir)
	src := filepath.Join(dir, "fakecuda.c")
	if err := os.WriteFile(src, source, 0o644); err != nil {
		return nil, err.Error()
	}
	lib := filepath.Join(dir, "libfakecuda.so")
	if out, err := exec.Command(cc, "-O2", "-shared", "-fPIC", "-pthread", "-o", lib, src).CombinedOutput(); err != nil {
		return nil, "build fake CUDA library: " + err.Error() + "\n" + string(out)
	}
	b, err := os.ReadFile(lib)
	if err != nil {
		return nil, err.Error()
	}
	return b, ""
}
