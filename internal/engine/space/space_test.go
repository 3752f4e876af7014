package space

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/fsys"
)

// newSpace returns a space of one mount of 1000 bytes holding two files
// of 100 bytes.
func newSpace(t *testing.T) *Space {
	t.Helper()
	sp := New()
	sp.Add(NewMount(MountConfig{Root: "/m", Configured: 1000, High: 0.9, Low: 0.8}, fsys.StatFS{}))
	c := sp.Counts()
	c.Indexed(0, 100, false)
	c.Indexed(0, 100, false)
	if err := sp.Check(); err != nil {
		t.Fatalf("a fresh space: %s", err)
	}
	return sp
}

// The index's own checks are its package's (index.TestCheckFindsEachBrokenInvariant).
func TestCheckFindsEachBrokenInvariant(t *testing.T) {
	if !InvariantsOn {
		t.Skip("the parts' checks are built with -tags invariants")
	}
	for _, tt := range []struct {
		name    string
		corrupt func(sp *Space)
		want    string
	}{
		{"more orphaned bytes than used", func(sp *Space) { sp.mounts[0].orphaned = 300 }, "orphaned"},
		{"a negative count of entries", func(sp *Space) { sp.mounts[0].entries = -1 }, "entries"},
		{"a high watermark above the capacity", func(sp *Space) { sp.mounts[0].high = 2000 }, "high"},
		{"spare bytes not their files'", func(sp *Space) {
			sp.mounts[0].addSpareLocked(Spare{Path: "/m/.spare-1", ID: fsys.Identity{Size: 50}})
			sp.mounts[0].spareBytes++
		}, "spares of 50 bytes"},
		{"a spare under another size", func(sp *Space) {
			sp.mounts[0].spares = map[int64][]Spare{60: {{Path: "/m/.spare-1", ID: fsys.Identity{Size: 50}}}}
		}, "listed under"},
		{"used beside the files at rest", func(sp *Space) { sp.mounts[0].used += 10 }, "at rest"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			sp := newSpace(t)
			sp.mu.Lock()
			tt.corrupt(sp)
			sp.mu.Unlock()
			err := errors.Join(sp.Check(), sp.UsageAtRest([]int64{200}, []int{2}))
			if got := fmt.Sprint(err); !strings.Contains(got, tt.want) {
				t.Fatalf("check after %s: %q, want an error containing %q", tt.name, got, tt.want)
			}
		})
	}
}
