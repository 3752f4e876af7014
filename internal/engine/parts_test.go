package engine

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/fsys"
)

// newSpace returns a space of one mount of 1000 bytes holding two files
// of 100 bytes.
func newSpace(t *testing.T) *space {
	t.Helper()
	ms := &mountSpace{root: "/m", highF: 0.9, lowF: 0.8}
	ms.setCapacityLocked(1000)
	sp := &space{mounts: []*mountSpace{ms}}
	c := indexCounts{sp}
	c.Indexed(0, 100, false)
	c.Indexed(0, 100, false)
	if err := sp.check(); err != nil {
		t.Fatalf("a fresh space: %s", err)
	}
	return sp
}

// The index's own checks are its package's (index.TestCheckFindsEachBrokenInvariant).
func TestSpaceCheckFindsEachBrokenInvariant(t *testing.T) {
	if !invariantsOn {
		t.Skip("the parts' checks are built with -tags invariants")
	}
	for _, tt := range []struct {
		name    string
		corrupt func(sp *space)
		want    string
	}{
		{"more orphaned bytes than used", func(sp *space) { sp.mounts[0].orphaned = 300 }, "orphaned"},
		{"a negative count of entries", func(sp *space) { sp.mounts[0].entries = -1 }, "entries"},
		{"a high watermark above the capacity", func(sp *space) { sp.mounts[0].high = 2000 }, "high"},
		{"spare bytes not their files'", func(sp *space) {
			sp.mounts[0].addSpareLocked(spareFile{path: "/m/.spare-1", id: fsys.Identity{Size: 50}})
			sp.mounts[0].spareBytes++
		}, "spares of 50 bytes"},
		{"a spare under another size", func(sp *space) {
			sp.mounts[0].spares = map[int64][]spareFile{60: {{path: "/m/.spare-1", id: fsys.Identity{Size: 50}}}}
		}, "listed under"},
		{"used beside the files at rest", func(sp *space) { sp.mounts[0].used += 10 }, "at rest"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			sp := newSpace(t)
			sp.mu.Lock()
			tt.corrupt(sp)
			sp.mu.Unlock()
			err := errors.Join(sp.check(), sp.usageAtRest([]int64{200}, []int{2}))
			if got := fmt.Sprint(err); !strings.Contains(got, tt.want) {
				t.Fatalf("check after %s: %q, want an error containing %q", tt.name, got, tt.want)
			}
		})
	}
}
