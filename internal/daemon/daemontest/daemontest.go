// Package daemontest holds test helpers shared by the daemon's tests and
// the kvhost command's.
package daemontest

import (
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/cuda/cudatest"
)

// BuildFakeCuFile compiles gds's fake libcufile (gds/testdata) with
// `go env CC`, as gds's own tests do, and returns its path. It skips
// the test where cudatest cannot build its fake CUDA library (no C
// compiler, no cgo).
func BuildFakeCuFile(t testing.TB) string {
	t.Helper()
	cudatest.Build(t) // skips without a C compiler
	out, err := exec.Command("go", "env", "CC").Output()
	if err != nil {
		t.Skipf("go env CC: %v", err)
	}
	cc := strings.Fields(string(out))
	if len(cc) == 0 {
		cc = []string{"cc"}
	}
	_, here, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("daemontest: cannot locate its own source")
	}
	src := filepath.Join(filepath.Dir(here), "..", "..", "..", "gds", "testdata", "fakecufile.c")
	lib := filepath.Join(t.TempDir(), "libcufile.so.0")
	args := append(cc[1:], "-shared", "-fPIC", "-O1", "-o", lib, src, "-lpthread")
	if out, err := exec.Command(cc[0], args...).CombinedOutput(); err != nil {
		t.Fatalf("build fake libcufile: %v\n%s", err, out)
	}
	return lib
}
