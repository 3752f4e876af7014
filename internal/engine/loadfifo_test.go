//go:build invariants

package engine

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/testwait"
)

// TestALoadOfAFileReplacedByANamedPipeDoesNotBlock: a key's file is
// indexed, then someone with write access to the mount puts a named pipe
// at its name. A load of the key opens the name to read it: it must not
// wait for a writer of the pipe (which would hold the load, its mover and
// every later load of the key forever), with O_DIRECT or without. It
// returns the key missing, and the entry is dropped: a lookup misses.
func TestALoadOfAFileReplacedByANamedPipeDoesNotBlock(t *testing.T) {
	for _, noDirect := range []bool{false, true} {
		t.Run(map[bool]string{false: "direct where the file system takes it", true: "buffered"}[noDirect], func(t *testing.T) {
			ctx := context.Background()
			dir := t.TempDir()
			pol := &fixedPathPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}
			name := "d/k.kv"
			pol.path.Store(&name)
			e := openEngine(t, Config{Mounts: []Mount{{Path: dir, NoDirect: noDirect}}, NewPolicy: func(policy.Index) (policy.Policy, error) { return pol, nil }})
			g := smallGeometry(true)
			ns, err := e.Declare(ctx, g)
			if err != nil {
				t.Fatal(err)
			}
			c := newTestCache(t, e, ns, g, 16, layoutPlaneFirst)
			key := []byte("k")
			keyContent(c, key, []int{0, 1, 2, 3})
			storeAndCheck(t, e, c, [][]byte{key}, [][]int{{0, 1, 2, 3}})
			p := filepath.Join(dir, name)
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			if err := syscall.Mkfifo(p, 0o644); err != nil {
				t.Fatal(err)
			}
			testwait.ReturnsDespitePipe(t, "a load", p, func() {
				res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: [][]byte{key}, Blocks: [][]int{{4, 5, 6, 7}}}))
				if k := res.Keys[0]; k.Outcome != OutcomeMissing || !errors.Is(k.Err, ErrNotFound) {
					t.Errorf("load of a named pipe: %v (%v), want missing with ErrNotFound", k.Outcome, k.Err)
				}
			})
			if n, err := e.Lookup(ctx, ns, [][]byte{key}); err != nil || n != 0 {
				t.Errorf("lookup after the load: %d keys stored (%v), want the entry dropped", n, err)
			}
		})
	}
}
