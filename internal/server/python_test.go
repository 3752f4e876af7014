package server_test

import (
	"bytes"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/internal/server"
)

// TestPythonSharedFile runs the Python client's shared-file checks
// (register_shared_file of a /dev/shm file, round trip, truncation) against
// a daemon that accepts shared files, then serves a Go client.
func TestPythonSharedFile(t *testing.T) {
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("python3 not installed")
	}
	if _, err := os.Stat("/dev/shm"); err != nil {
		t.Skip("no /dev/shm on this machine")
	}
	f := newFixture(t, server.Config{SharedFiles: true})
	src, err := filepath.Abs("../../client/python/src")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("python3", "../../client/testdata/client_test.py", f.socket, "pyshared", "shared")
	cmd.Env = append(os.Environ(), "PYTHONPATH="+src, "PYTHONDONTWRITEBYTECODE=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	t.Logf("%s", out)
	k := newCache(t, f.dial(t))
	want := k.store(t, "after-python", []uint32{0, 1}, rand.New(rand.NewPCG(9, 9)))
	if got := k.load(t, "after-python", []uint32{2, 3}); !bytes.Equal(got, want) {
		t.Fatal("the next client's round trip differs")
	}
}
