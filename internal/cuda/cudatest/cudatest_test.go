package cudatest_test

import (
	"errors"
	"io/fs"
	"os"
	"testing"

	"github.com/kvhost/kvhost/internal/cuda/cudatest"
)

// TestBuildLeavesNothingBehindOnceTheTestEnds builds the fake library
// in a subtest with the temporary directory pointed at an empty one:
// the library is there while the subtest runs, and once it ends neither
// the library nor the compiler's directory is left.
func TestBuildLeavesNothingBehindOnceTheTestEnds(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	var lib string
	t.Run("build", func(t *testing.T) {
		lib = cudatest.Build(t)
		if st, err := os.Stat(lib); err != nil || st.Size() == 0 {
			t.Fatalf("the built library %s: %v, %v", lib, st, err)
		}
	})
	if _, err := os.Stat(lib); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the library %s is still there after its test: %v", lib, err)
	}
	left, err := os.ReadDir(tmp)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range left {
		t.Errorf("left in the temporary directory: %s", e.Name())
	}
}
