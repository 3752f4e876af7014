package gpu

import (
	"errors"
	"testing"
	"time"
)

// TestReadChoiceTakesTheCheaperWayAndTriesTheOtherOneLoadInEight: the
// fixed ways never change; the adaptive one tries each way once, then
// takes the way whose loads cost less per byte, and the other on one
// pick in exploreEvery; loads that had no choice (too small to map) do
// not move the costs.
func TestReadChoiceTakesTheCheaperWayAndTriesTheOtherOneLoadInEight(t *testing.T) {
	for _, way := range []ReadWay{ReadsMapped, ReadsPread} {
		c := &readChoice{way: way}
		c.record(false, true, 1<<20, time.Millisecond)
		c.record(true, true, 1<<20, time.Second)
		for range 2 * exploreEvery {
			if got := c.pick(); got != (way == ReadsMapped) {
				t.Fatalf("way %d: picked mapped %v", way, got)
			}
		}
	}
	c := &readChoice{way: ReadsAdaptive}
	if !c.pick() {
		t.Fatal("first adaptive pick: pread, want a mapping (no cost known)")
	}
	c.record(true, true, 1<<20, 2*time.Millisecond) // mapped: about 2 ns a byte
	if c.pick() {
		t.Fatal("second adaptive pick: a mapping, want pread (its cost unknown)")
	}
	c.record(false, false, 1<<20, time.Hour) // no choice: not a cost
	if c.cost[1] != 0 {
		t.Fatalf("a load with no choice set pread's cost to %v", c.cost[1])
	}
	c.record(false, true, 1<<20, time.Millisecond) // pread: about 1 ns a byte
	mapped := 0
	for range 4 * exploreEvery {
		if c.pick() {
			mapped++
		}
	}
	if mapped != 4 {
		t.Fatalf("%d of %d picks took the dearer mapping, want 4 (one in %d)", mapped, 4*exploreEvery, exploreEvery)
	}
	// The mapping gets cheaper than pread: the choice follows.
	for range 20 {
		c.record(true, true, 1<<20, 100*time.Microsecond)
	}
	if !c.pick() {
		t.Fatal("after mapped loads got cheaper: picked pread")
	}
	// Every load recorded is counted by its way, picked or not.
	if m, p := c.mapped.Load(), c.pread.Load(); m != 21 || p != 2 {
		t.Fatalf("counted %d mapped and %d pread loads, want 21 and 2", m, p)
	}
}

func TestParseReadWay(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want ReadWay
		err  bool
	}{
		{"", ReadsAdaptive, false}, {"auto", ReadsAdaptive, false}, {"mapped", ReadsMapped, false},
		{"pread", ReadsPread, false}, {"mmap", 0, true},
	} {
		got, err := ParseReadWay(tc.in)
		if (err != nil) != tc.err || (err == nil && got != tc.want) || (err != nil && !errors.Is(err, errConfig)) {
			t.Errorf("ParseReadWay(%q) = %v, %v", tc.in, got, err)
		}
	}
}

// TestLoadsReadTheirFileTheWayConfigured: a load of a memory-mount file
// large enough to map, not registered, reads it through a mapping or
// with pread as Config.Reads says, and the adaptive way tries both
// first; every load's bytes and checksums are verified.
func TestLoadsReadTheirFileTheWayConfigured(t *testing.T) {
	g := geometry{layers: 4, numBlocks: 32, pageBytes: 256 << 10, blocksPerKey: 16, headerBytes: 4096} // 16 MiB keys
	for _, tc := range []struct {
		name          string
		way           ReadWay
		loads         int
		mapped, pread uint64
	}{
		{"mapped", ReadsMapped, 2, 2, 0},
		{"pread", ReadsPread, 2, 0, 2},
		{"adaptive", ReadsAdaptive, 2, 1, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			m := e.mover(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Reads: tc.way})
			kv := newCache(t, e.w, g)
			orig := kv.randomize(t, e.w, 1)
			host := hostCopies(kv, orig)
			kf := newKeyFile(t, kv, t.TempDir(), "key", 1)
			store(t, e, m, kv, kf, host, orig)
			for range tc.loads {
				load(t, e, m, kv, kf, host, orig)
			}
			if mp, pr := m.ReadCounts(); mp != tc.mapped || pr != tc.pread {
				t.Fatalf("%d loads read %d files through a mapping and %d with pread, want %d and %d", tc.loads, mp, pr, tc.mapped, tc.pread)
			}
		})
	}
}
