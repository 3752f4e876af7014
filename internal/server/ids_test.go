package server

import (
	"math"
	"testing"
)

// TestIDsSkipZeroAndThoseInUseWhenTheCounterWraps: a connection's ids are
// u32 from one counter; once it wraps, the ids handed out are never 0 and
// never one of a region, namespace or cache still registered (which a
// later unregister would then remove in its place).
func TestIDsSkipZeroAndThoseInUseWhenTheCounterWraps(t *testing.T) {
	s := &session{
		regions:    map[uint32]*memRegion{1: {}},
		namespaces: map[uint32]*namespace{2: {}},
		caches:     map[uint32]*cache{math.MaxUint32: {}, 4: {}},
		nextID:     math.MaxUint32 - 2,
	}
	want := []uint32{math.MaxUint32 - 1, 3, 5}
	for _, w := range want {
		if got := s.newID(); got != w {
			t.Fatalf("new id %d, want %d (ids in use: regions 1, namespaces 2, caches 4 and %d)", got, w, uint32(math.MaxUint32))
		}
	}
}

// TestConfigLeavesAFreeID: limits that would let a connection hold every
// u32 id are refused, so newID always finds a free one.
func TestConfigLeavesAFreeID(t *testing.T) {
	if _, err := (Config{MaxRegistrations: 1, MaxNamespaces: 1, MaxCaches: math.MaxUint32 - 2}).withDefaults(); err == nil {
		t.Fatal("limits adding up to 2^32-1 ids accepted")
	}
	if _, err := (Config{MaxCaches: 1 << 20}).withDefaults(); err != nil {
		t.Fatal(err)
	}
}
