//go:build invariants

package engine

import (
	"bytes"
	"context"
	"os"
	"sync"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
)

// rewriteFS rewrites the file at path in place with with, once, when a
// reader of it (opened read-only after arm) reads past its first byte:
// what another engine on a memory mount's directory does to a file it
// evicted and kept as a spare, then reused for a store of its own.
type rewriteFS struct {
	fsys.OS
	mu   sync.Mutex
	path string
	with []byte
	done bool
	err  error
}

func (r *rewriteFS) arm(path string, with []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.path, r.with = path, with
}

func (r *rewriteFS) rewrite() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done || r.path == "" {
		return
	}
	r.done = true
	f, err := os.OpenFile(r.path, os.O_WRONLY, 0)
	if err == nil {
		_, err = f.WriteAt(r.with, 0)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	r.err = err
}

func (r *rewriteFS) OpenFile(name string, flag int, perm os.FileMode) (fsys.File, error) {
	f, err := r.OS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return r.wrap(f, name, flag), nil
}

// OpenAt is OpenFile relative to dir, as the engine may open a name.
func (r *rewriteFS) OpenAt(dir fsys.File, path string, flag int, perm os.FileMode) (fsys.File, error) {
	f, err := r.OS.OpenAt(dir, path, flag, perm)
	if err != nil {
		return nil, err
	}
	return r.wrap(f, path, flag), nil
}

// wrap returns f, just opened at name with flag, as a rewriteFile where
// it is the armed file opened for reading.
func (r *rewriteFS) wrap(f fsys.File, name string, flag int) fsys.File {
	r.mu.Lock()
	armed := name == r.path && flag&(os.O_WRONLY|os.O_RDWR) == 0
	r.mu.Unlock()
	if !armed {
		return f
	}
	return rewriteFile{f, r}
}

type rewriteFile struct {
	fsys.File
	r *rewriteFS
}

func (f rewriteFile) ReadAt(p []byte, off int64) (int, error) {
	if off > 0 {
		f.r.rewrite()
	}
	return f.File.ReadAt(p, off)
}

// TestAMoveOfAFileRewrittenWhileCopiedFails: a move copies its source in
// chunks; where the source, on a memory mount, is rewritten in place
// meanwhile (another engine on the directory evicted it, kept it as a
// spare and stored into it), the copy would hold the old header over
// another file's payload, and on a mount without checksums serve those
// bytes for the old keys, after every restart too. The move must check
// the source's header after the copy, as a load does, and leave nothing
// that loads wrong bytes.
func TestAMoveOfAFileRewrittenWhileCopiedFails(t *testing.T) {
	ctx := context.Background()
	hot, cold := tmpfsDir(t), t.TempDir()
	fs := &rewriteFS{}
	e := openEngine(t, Config{
		Mounts: []Mount{{Path: hot}, {Path: cold, NoChecksum: true}},
		Policy: newTestPolicy(16, abi.OrderLayerMajor), FS: fs, NoReuse: true,
	})
	g := smallGeometry(true)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 192, layoutPlaneFirst)
	// Two files of 16 keys, 2 MiB of payload each: a move copies them
	// in two chunks.
	aKeys, bKeys := testKeys("a", 16), testKeys("b", 16)
	var aBlocks, bBlocks, into [][]int
	for i := range 16 {
		aBlocks = append(aBlocks, []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3})
		bBlocks = append(bBlocks, []int{64 + 4*i, 64 + 4*i + 1, 64 + 4*i + 2, 64 + 4*i + 3})
		into = append(into, []int{128 + 4*i, 128 + 4*i + 1, 128 + 4*i + 2, 128 + 4*i + 3})
	}
	var want [][]byte
	for i := range 16 {
		keyContent(c, aKeys[i], aBlocks[i])
		keyContent(c, bKeys[i], bBlocks[i])
		want = append(want, c.data(aBlocks[i]))
	}
	storeAndCheck(t, e, c, aKeys, aBlocks)
	storeAndCheck(t, e, c, bKeys, bBlocks)
	a, b := e.find(e.tables.get(ns), aKeys[0]), e.find(e.tables.get(ns), bKeys[0])
	if a == nil || b == nil || a.Mount != 0 || a.Size <= copyChunk {
		t.Fatalf("files stored: %+v, %+v", a, b)
	}
	bBytes, err := os.ReadFile(b.Path)
	if err != nil {
		t.Fatal(err)
	}
	if int64(len(bBytes)) != a.Size {
		t.Fatalf("files of %d and %d bytes", a.Size, len(bBytes))
	}

	fs.arm(a.Path, bBytes)
	_, moveErr := e.tier.move(ctx, a.ID, 1, false)
	if !fs.done || fs.err != nil {
		t.Fatalf("the source was not rewritten during the copy (rewritten %v: %v)", fs.done, fs.err)
	}
	t.Logf("move: %v", moveErr)

	// Whatever the move did, no key of the old file loads other bytes
	// than its own.
	res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: aKeys, Blocks: into}))
	for i, k := range res.Keys {
		if k.Outcome == OutcomeLoaded && !bytes.Equal(c.data(into[i]), want[i]) {
			t.Fatalf("key %s: loaded another file's bytes after a move of its rewritten source", aKeys[i])
		}
	}
	if err := e.check(); err != nil {
		t.Fatal(err)
	}
}
