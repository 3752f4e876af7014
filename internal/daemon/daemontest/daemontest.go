// Package daemontest holds test helpers shared by the daemon's tests and
// the kvhost command's.
package daemontest

import (
	"os/exec"
	"path/filepath"
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
	// The module's directory from go, not from runtime.Caller: under
	// -trimpath (`make test`) a source file's recorded path is not one
	// on disk.
	dir, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}").Output()
	if err != nil {
		t.Fatalf("daemontest: go list -m: %v", err)
	}
	src := filepath.Join(strings.TrimSpace(string(dir)), "gds", "testdata", "fakecufile.c")
	lib := filepath.Join(t.TempDir(), "libcufile.so.0")
	args := append(cc[1:], "-shared", "-fPIC", "-O1", "-o", lib, src, "-lpthread")
	if out, err := exec.Command(cc[0], args...).CombinedOutput(); err != nil {
		t.Fatalf("build fake libcufile: %v\n%s", err, out)
	}
	return lib
}
