//go:build invariants

package engine

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/format"
)

// TestARepeatedKeyOfACorruptFileIsNotReportedLoaded: a load that names a
// key twice reads the file once per destination (rounds). Where another
// key of the same file fails its checksum in the first round and the
// file is judged corrupt, the rounds stop: the repeated key's later
// destination was never read, and must not be reported loaded.
func TestARepeatedKeyOfACorruptFileIsNotReportedLoaded(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(2, abi.OrderBlockMajor)})
	ns, c := declareSmall(t, e, 64)
	r := rand.New(rand.NewPCG(7, 7))
	keys := testKeys("rep", 2)
	blocks := [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}
	for _, b := range blocks {
		c.fill(r, b)
	}
	storeAndCheck(t, e, c, keys, blocks)
	a := c.data(blocks[0])
	en := e.find(e.tables.get(ns), keys[0])
	if en == nil || len(en.Keys) != 2 || en.Keys[1] != string(keys[1]) {
		t.Fatalf("want one file of both keys, got %+v", en)
	}
	// Corrupt the second key's payload (block-major: after the first
	// key's).
	h := e.tables.get(ns).geo
	flipByte(t, en.Path, int64(format.Align)+h.KeyBytes()+100)

	req := [][]byte{keys[0], keys[1], keys[0]}
	into := [][]int{{8, 9, 10, 11}, {12, 13, 14, 15}, {16, 17, 18, 19}}
	for _, b := range into {
		c.clear(b)
	}
	res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: req, Blocks: into}))
	if k := res.Keys[1]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrCorrupt) {
		t.Fatalf("the corrupt key: %v %v; want failed, corrupt", k.Outcome, k.Err)
	}
	for i, k := range res.Keys {
		t.Logf("destination %d: %v %v", i, k.Outcome, k.Err)
		if k.Outcome == OutcomeLoaded && !bytes.Equal(c.data(into[i]), a) {
			t.Errorf("destination %d of key %q reported loaded, but its blocks do not hold the key's bytes", i, req[i])
		}
	}
}

// flipByte inverts the byte at off of the file at path, as a writer
// that is not the engine would.
func flipByte(t *testing.T, path string, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := []byte{0}
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0xff
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}
