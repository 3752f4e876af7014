//go:build invariants

package engine

import (
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
)

// TestAnIndexedFileBehindALinkAtItsPathIsNotTakenForIt: someone who can
// write the mount moved an indexed file aside and put a symbolic link to
// it at its path. The check a store makes before it answers present, and
// a move's open of its source (openSame), both opened the path following
// the link, found the indexed inode there and took the link for the
// file: a move then read through the link. Both now open the path
// without following links, as every other open of a data file does (a
// load takes a link there for a vanished file): the check drops the
// entry, and the file aside is left alone.
func TestAnIndexedFileBehindALinkAtItsPathIsNotTakenForIt(t *testing.T) {
	dir := t.TempDir()
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0)})
	g := smallGeometry(false)
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 8, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(3, 4))
	keys, blocks := testKeys("samelink", 1), blockLists(r, 1, g.BlocksPerKey(), 0)
	c.fill(r, blocks[0])
	storeAndCheck(t, e, c, keys, blocks)
	en := entryOf(e, ns, keys[0])
	if en == nil {
		t.Fatal("the stored key is not indexed")
	}
	aside := filepath.Join(t.TempDir(), "aside.kv")
	if err := os.Rename(en.Path, aside); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(aside, en.Path); err != nil {
		t.Fatal(err)
	}
	if f, _, err := e.hd.openSame(en, os.O_RDONLY); err == nil {
		f.Close()
		t.Errorf("openSame of %s, a link to the indexed file: opened, want refused", en.Path)
	}
	if e.shared.confirm(context.Background(), en) {
		t.Errorf("the check before a store answers present took the link at %s for the indexed file", en.Path)
	}
	if got := entryOf(e, ns, keys[0]); got != nil {
		t.Errorf("the key is still indexed at %s, behind a link", got.Path)
	}
	if _, err := os.Stat(aside); err != nil {
		t.Errorf("the file the link points to: %v, want it left alone", err)
	}
}
