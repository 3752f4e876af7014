//go:build invariants

package engine

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
)

// fixedPathPolicy names every key's file path on mount 0.
type fixedPathPolicy struct {
	*testPolicy
	path atomic.Pointer[string]
}

func (p *fixedPathPolicy) Name(ctx context.Context, recs []abi.NameRecord) error {
	if err := p.testPolicy.Name(ctx, recs); err != nil {
		return err
	}
	for i := range recs {
		recs[i].Mount = 0
		recs[i].PathLen = uint32(copy(recs[i].PathBuf[:], *p.path.Load()))
	}
	return nil
}

// TestAStoreNeverWritesThroughALinkPlantedInItsMount: someone planted a
// symbolic link to a directory outside the mount where the policy's name
// for a key (a valid relative path) has a directory. The store fails with
// ErrPolicy and writes nothing outside the mount, not even a directory
// (a name one level below the link); a store named under a real directory
// of the mount still succeeds.
func TestAStoreNeverWritesThroughALinkPlantedInItsMount(t *testing.T) {
	dir, outside := t.TempDir(), t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "real"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(dir, "real", "link")); err != nil {
		t.Fatal(err)
	}
	pol := &fixedPathPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}
	linked, real := "real/link/k.kv", "real/k.kv"
	pol.path.Store(&linked)
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, NewPolicy: func(policy.Index) (policy.Policy, error) { return pol, nil }})
	g := smallGeometry(false)
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(1, 2))
	keys, blocks := testKeys("planted", 2), blockLists(r, 2, g.BlocksPerKey(), 0)
	for _, b := range blocks {
		c.fill(r, b)
	}
	for _, name := range []string{linked, "real/link/sub/k.kv"} {
		pol.path.Store(&name)
		res := wait(t)(e.Store(context.Background(), StoreRequest{Cache: c.id, Keys: keys[:1], Blocks: blocks[:1]}))
		if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrPolicy) {
			t.Errorf("store named %s, through a planted link: %v (%v), want failed with ErrPolicy", name, k.Outcome, k.Err)
		}
	}
	if ents, _ := os.ReadDir(outside); len(ents) != 0 {
		t.Errorf("the store wrote outside its mount, through the link: %v", ents)
	}
	if st := e.Stats(); st.Entries != 0 || st.Mounts[0].Used != 0 {
		t.Errorf("after the refused store: %d entries, %d bytes used; want none", st.Entries, st.Mounts[0].Used)
	}
	pol.path.Store(&real)
	storeAndCheck(t, e, c, keys[1:], blocks[1:])
	loadAndCompare(t, e, c, keys[1:], [][]int{{8, 9, 10, 11}}, [][]byte{c.data(blocks[1])})
}
