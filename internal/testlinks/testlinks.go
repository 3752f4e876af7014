// Package testlinks is for tests of code that must act through no
// symbolic link: a directory outside the tree under test for a planted
// link to point to (Target), a link planted at a name (Plant) or in place
// of a directory (Swap), and the check that nothing was made, removed or
// changed where the link points (Target.Untouched). It imports no package
// of kvhost's, so that internal/fsys's own tests can use it.
package testlinks

import (
	"maps"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// Target is a directory for a planted link to point to, outside the tree
// under test, and the files it was made with.
type Target struct {
	// Dir is the directory's path.
	Dir   string
	files map[string][]byte // name → contents
}

// NewTarget makes a new directory, removed when t ends, holding files
// (name → contents).
func NewTarget(t testing.TB, files map[string][]byte) *Target {
	t.Helper()
	dir := t.TempDir()
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return &Target{Dir: dir, files: maps.Clone(files)}
}

// Untouched fails t (Errorf) unless the target's directory holds the
// files it was made with, no more and no fewer, each with its contents:
// nothing was made, removed or written through a link to it.
func (tg *Target) Untouched(t testing.TB) {
	t.Helper()
	ents, err := os.ReadDir(tg.Dir)
	if err != nil {
		t.Errorf("where the link points (%s): %v", tg.Dir, err)
		return
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if want := slices.Sorted(maps.Keys(tg.files)); !slices.Equal(names, want) {
		t.Errorf("where the link points (%s): %v, want only %v, as they were", tg.Dir, names, want)
	}
	for name, data := range tg.files {
		if got, err := os.ReadFile(filepath.Join(tg.Dir, name)); err != nil || !slices.Equal(got, data) {
			t.Errorf("%s where the link points was changed through the link (%v)", name, err)
		}
	}
}

// Plant puts a symbolic link to target at name, failing t (Fatal) if it
// cannot.
func Plant(t testing.TB, name, target string) {
	t.Helper()
	if err := os.Symlink(target, name); err != nil {
		t.Fatal(err)
	}
}

// Swap renames the directory dir to dir+".old" and plants a symbolic
// link to target in its place, as someone who can write dir's parent
// may; it fails t (Fatal) if it cannot.
func Swap(t testing.TB, dir, target string) {
	t.Helper()
	if err := os.Rename(dir, dir+".old"); err != nil {
		t.Fatal(err)
	}
	Plant(t, dir, target)
}
