//go:build invariants

package engine

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/kvhost/kvhost/abi"
)

// TestAVllmFSLoadNeverServesAReplacedRowOfAnotherLength: a row indexed
// at the namespace's length is replaced at its name by a longer file (a
// vLLM whose rows, for fields that do not cover the whole geometry, are
// another length). The load does not serve the longer file's first
// bytes as the row, as a lookup would not index it: a miss, the file
// left alone.
func TestAVllmFSLoadNeverServesAReplacedRowOfAnotherLength(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	const row = 8192
	tier := newFSTier(root, row)
	tier.init(t)
	keys := tierKeys(12, 1)
	tier.store(t, keys[0], randomRow(rand.New(rand.NewPCG(7, 8)), row))
	e := openEngine(t, Config{Mounts: []Mount{{Path: root, VLLMFS: &VLLMFS{Namespace: tierModel, Fields: tier.fields()}}}, Policy: newTestPolicy(4, abi.OrderBlockMajor)})
	g := rowGeometry(tierModel, row)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	longer := newFSTier(root, 2*row)
	other := randomRow(rand.New(rand.NewPCG(9, 10)), 2*row)
	longer.store(t, keys[0], other)
	c := newTestCache(t, e, ns, g, 1, layoutPlaneFirst)
	res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys, Blocks: [][]int{{0}}}))
	if k := res.Keys[0]; k.Outcome == OutcomeLoaded || bytes.Equal(c.data([]int{0}), other[:row]) {
		t.Errorf("load served the first %d bytes of a %d-byte file as the row: %v", row, 2*row, k.Outcome)
	}
	if n, err := e.Lookup(ctx, ns, keys); n != 0 || err != nil {
		t.Errorf("lookup after the load: %d, %v; want a miss", n, err)
	}
	if fi, err := os.Stat(tier.path(keys[0])); err != nil || fi.Size() != int64(2*row) {
		t.Errorf("the longer file: %v, %v; want it left alone", fi, err)
	}
}
