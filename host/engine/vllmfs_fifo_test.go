package engine

import (
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/testwait"
)

// TestAVllmFSNamedPipeAtARowNameBlocksNoRequest: a named pipe sits where
// a key's row would be (planted in vLLM's shared directory, or left by a
// tool), or replaced a row indexed before. A lookup of the key is a miss
// and a delete of it returns: neither waits for a writer of the pipe,
// which would hold the request, and every later one of the key, forever.
func TestAVllmFSNamedPipeAtARowNameBlocksNoRequest(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	const row = 8192
	tier := newFSTier(root, row)
	tier.init(t)
	keys := tierKeys(9, 2)
	tier.store(t, keys[1], randomRow(rand.New(rand.NewPCG(1, 1)), row))
	e := openEngine(t, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Namespace: tierModel, Fields: tier.fields()}}}, Policy: newTestPolicy(4, abi.OrderBlockMajor)})
	ns, err := e.Declare(ctx, rowGeometry(tierModel, row))
	if err != nil {
		t.Fatal(err)
	}
	if st := e.Stats(); st.Entries != 1 {
		t.Fatalf("%d entries after open, want the row", st.Entries)
	}
	for _, k := range keys {
		p := tier.path(k)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		os.Remove(p)
		if err := syscall.Mkfifo(p, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	testwait.ReturnsDespitePipe(t, "a lookup", tier.path(keys[0]), func() {
		if n, err := e.Lookup(ctx, ns, keys[:1]); n != 0 || err != nil {
			t.Errorf("lookup: %d, %v; want a miss", n, err)
		}
	})
	testwait.ReturnsDespitePipe(t, "a delete", tier.path(keys[1]), func() {
		if _, err := e.Delete(ctx, ns, keys[1:]); err != nil {
			t.Logf("delete: %v", err)
		}
	})
}
