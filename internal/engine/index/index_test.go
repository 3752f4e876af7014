package index

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/kvhost/kvhost/abi"
)

// fakeMount is one mount's counts as the space part keeps them.
type fakeMount struct{ used, entries, orphaned int64 }

// fakeSpace counts what the index tells it (Space) as the engine's space
// does, with its own check of the counts.
type fakeSpace struct {
	mu     sync.Mutex
	mounts []*fakeMount
}

func newFakeSpace(n int) *fakeSpace {
	sp := &fakeSpace{}
	for range n {
		sp.mounts = append(sp.mounts, &fakeMount{})
	}
	return sp
}

func (s *fakeSpace) do(mount int, fn func(m *fakeMount)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	fn(s.mounts[mount])
}

func (s *fakeSpace) Free(mount int, size int64, orphan bool) {
	s.do(mount, func(m *fakeMount) {
		m.used -= size
		if orphan {
			m.orphaned -= size
		}
	})
}
func (s *fakeSpace) Left(mount int, size int64) { s.do(mount, func(m *fakeMount) { m.used += size }) }
func (s *fakeSpace) Unorphan(mount int, size int64) {
	s.do(mount, func(m *fakeMount) { m.orphaned -= size })
}
func (s *fakeSpace) Indexed(mount int, size int64, reserved bool) {
	s.do(mount, func(m *fakeMount) {
		if !reserved {
			m.used += size
		}
		m.entries++
	})
}
func (s *fakeSpace) Unindexed(mount int, size int64, removing, orphan bool) {
	s.do(mount, func(m *fakeMount) {
		m.entries--
		if !removing {
			m.used -= size
		}
		if orphan {
			m.orphaned += size
		}
	})
}
func (s *fakeSpace) Moved(from, to int) { s.do(from, func(m *fakeMount) { m.entries-- }) }

// usageAtRest is the space's side of Index.CheckAtRest.
func (s *fakeSpace) usageAtRest(used []int64, n []int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, m := range s.mounts {
		if m.used != used[i] || m.entries != int64(n[i]) || m.orphaned != 0 {
			return fmt.Errorf("index at rest: mount %d: used %d, entries %d, orphaned %d; its files: %d bytes, %d entries", i, m.used, m.entries, m.orphaned, used[i], n[i])
		}
	}
	return nil
}

// newParts returns an index over a space of one mount, with two entries
// of 100 bytes: one of keys a and b at /m/x, one of key c at /m/y.
func newParts(t *testing.T) (*Index, *fakeSpace) {
	t.Helper()
	sp := newFakeSpace(1)
	ix := NewIndex(sp)
	ix.mu.Lock()
	ix.insertLocked(&Entry{FP: 1, Path: "/m/x", Size: 100, Keys: []string{"a", "b"}}, false)
	ix.insertLocked(&Entry{FP: 1, Path: "/m/y", Size: 100, Keys: []string{"c"}}, false)
	ix.mu.Unlock()
	if err := errorsOf(ix, sp); err != "" {
		t.Fatalf("a fresh index: %s", err)
	}
	return ix, sp
}

func errorsOf(ix *Index, sp *fakeSpace) string {
	var out []string
	for _, err := range []error{ix.Check(), ix.CheckAtRest(len(sp.mounts), sp.usageAtRest)} {
		if err != nil {
			out = append(out, err.Error())
		}
	}
	return strings.Join(out, "; ")
}

func TestCheckFindsEachBrokenInvariant(t *testing.T) {
	if !InvariantsOn {
		t.Skip("the index's checks are built with -tags invariants")
	}
	for _, tt := range []struct {
		name    string
		corrupt func(ix *Index, sp *fakeSpace)
		want    string
	}{
		{"an indexed entry marked gone", func(ix *Index, _ *fakeSpace) { ix.files.byPath["/m/x"].gone = true }, "indexed and gone"},
		{"an entry under another id", func(ix *Index, _ *fakeSpace) { ix.files.byPath["/m/x"].ID = 7 }, "under id"},
		{"a path mapping to another entry", func(ix *Index, _ *fakeSpace) { ix.files.byPath["/m/x"] = ix.files.byPath["/m/y"] }, "maps to"},
		{"a key of an entry that does not hold it", func(ix *Index, _ *fakeSpace) {
			ix.files.byKey[KeyID{1, "c"}] = keyRef{e: ix.files.byPath["/m/x"], idx: 0}
		}, "does not hold it"},
		{"a key of another fingerprint", func(ix *Index, _ *fakeSpace) {
			ix.files.byKey[KeyID{2, "a"}] = keyRef{e: ix.files.byPath["/m/x"], idx: 0}
		}, "does not hold it"},
		{"more leases than pins", func(ix *Index, _ *fakeSpace) { ix.files.byPath["/m/x"].leases = 1 }, "leases"},
		{"an orphan still indexed", func(ix *Index, _ *fakeSpace) {
			ix.flights.inflight["/m/x"] = &Flight{orphans: []*Entry{ix.files.byPath["/m/x"]}}
		}, "orphan"},
		{"used beside the files at rest", func(_ *Index, sp *fakeSpace) { sp.mounts[0].used += 10 }, "at rest"},
		{"a held entry missing from its mount's held entries", func(ix *Index, _ *fakeSpace) {
			en := ix.files.byPath["/m/x"]
			en.held, en.pins = true, 1
		}, "missing from mount 0's held entries"},
		{"a held entry under another mount", func(ix *Index, _ *fakeSpace) {
			en := ix.files.byPath["/m/x"]
			ix.pins.holdLocked(en)
			ix.pins.heldOrder[0] = nil
			ix.pins.heldOrder[1] = []*Entry{en}
		}, "missing from mount 0's held entries"},
		{"an entry not held in the hold's count", func(ix *Index, _ *fakeSpace) {
			ix.pins.heldN = 1
		}, "0 entries held by the restart hold, 1 in the hold's count"},
		{"a namespace's keys miscounted", func(ix *Index, _ *fakeSpace) { ix.counts.byFP[1].Keys++ }, "fingerprint 0x1"},
		{"a namespace's bytes miscounted", func(ix *Index, _ *fakeSpace) { ix.counts.byFP[1].Bytes-- }, "fingerprint 0x1"},
		{"a namespace with nothing indexed counted", func(ix *Index, _ *fakeSpace) { ix.counts.byFP[9] = &FPCount{} }, "2 counted"},
		{"a held entry missing from its mount's order of held entries", func(ix *Index, _ *fakeSpace) {
			ix.pins.holdLocked(ix.files.byPath["/m/x"])
			ix.pins.heldOrder[0] = nil
		}, "missing from mount 0's held entries"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ix, sp := newParts(t)
			ix.mu.Lock()
			sp.mu.Lock()
			tt.corrupt(ix, sp)
			sp.mu.Unlock()
			ix.mu.Unlock()
			if got := errorsOf(ix, sp); !strings.Contains(got, tt.want) {
				t.Fatalf("check after %s: %q, want an error containing %q", tt.name, got, tt.want)
			}
		})
	}
}

func TestIndexKeepsTheSpaceOfItsEntries(t *testing.T) {
	ix, sp := newParts(t)
	ms := sp.mounts[0]
	x, y := ix.files.Get(1, []byte("a")), ix.files.Get(1, []byte("c"))
	ix.mu.Lock()
	// A file replacing x at its path (its bytes a reservation already
	// counted), then y dropped for removal with its path held by a job.
	sp.Left(0, 100) // the reservation

	replaced := ix.insertLocked(&Entry{FP: 1, Path: "/m/x", Size: 100, Keys: []string{"a"}}, true)
	ix.flights.claimLocked("/m/y")
	was, claimed := ix.dropLocked(y, true)
	ix.mu.Unlock()
	if len(replaced) != 1 || replaced[0] != x || !x.gone {
		t.Fatalf("insert at x's path replaced %v, want x", replaced)
	}
	if !was || claimed || !y.orphan {
		t.Fatalf("drop of y with its path held: was %v, claimed %v, orphan %v; want an orphan of the holder", was, claimed, y.orphan)
	}
	if got := ix.files.Get(1, []byte("b")); got != nil {
		t.Fatalf("key b of the replaced file still maps to %s", got.Path)
	}
	if used := ms.used; used != 200 || ms.entries != 1 || ms.orphaned != 100 {
		t.Fatalf("used %d, entries %d, orphaned %d; want 200 (the new file and the orphan), 1, 100", used, ms.entries, ms.orphaned)
	}
	if err := errorsOf(ix, sp); err != "" {
		t.Fatalf("check with y's path held: %s", err)
	}
	// The holder removes the orphan and lets the path go.
	ix.mu.Lock()
	fl, orphans := ix.releaseLocked("/m/y", nil)
	if fl != nil || len(orphans) != 1 {
		t.Fatalf("release of a path with an orphan: flight %v, orphans %d; want the orphan to remove first", fl, len(orphans))
	}
	if fl, _ = ix.releaseLocked("/m/y", orphans); fl == nil {
		t.Fatal("the second release kept the path")
	}
	ix.mu.Unlock()
	if err := errorsOf(ix, sp); err != "" {
		t.Fatalf("check at rest after the release: %s", err)
	}
	if used := ms.used; used != 100 {
		t.Fatalf("used %d at rest, want 100 (the new file)", used)
	}
}

// TestHeldEntriesAreKeptByTheirMount: the restart hold's entries are
// listed under their own mount (what a demotion round on one mount
// visits), counted across mounts, and a held entry is no longer held nor
// counted when it leaves the index (its listing stays until the hold
// ends, and visits skip it).
func TestHeldEntriesAreKeptByTheirMount(t *testing.T) {
	ix := NewIndex(newFakeSpace(2))
	ix.mu.Lock()
	hot1 := &Entry{FP: 1, Path: "/hot/a", Size: 100, Keys: []string{"a"}}
	hot2 := &Entry{FP: 1, Path: "/hot/b", Size: 100, Keys: []string{"b"}}
	cold := &Entry{FP: 1, Path: "/cold/c", Size: 100, Keys: []string{"c"}, Mount: 1}
	for _, en := range []*Entry{hot1, hot2, cold} {
		ix.insertLocked(en, false)
		ix.pins.holdLocked(en)
	}
	ix.mu.Unlock()
	if n := ix.pins.HeldFound(); n != 3 {
		t.Fatalf("heldFoundLocked = %d, want 3", n)
	}
	if len(ix.pins.heldOrder[0]) != 2 || len(ix.pins.heldOrder[1]) != 1 {
		t.Fatalf("held by mount: %d on the hot mount, %d on the cold one; want 2 and 1", len(ix.pins.heldOrder[0]), len(ix.pins.heldOrder[1]))
	}
	if ix.pins.heldOrder[1][0] != cold {
		t.Fatal("the cold mount's held entries lack its file")
	}
	if err := ix.Check(); err != nil {
		t.Fatal(err)
	}
	ix.mu.Lock()
	ix.unindexLocked(hot1, false)
	ix.mu.Unlock()
	if hot1.held || hot1.pins != 0 {
		t.Fatalf("an entry gone from the index: held %v, pins %d; want not held, 0", hot1.held, hot1.pins)
	}
	if n := ix.pins.HeldFound(); n != 2 {
		t.Fatalf("heldFoundLocked = %d after one held entry left, want 2", n)
	}
	if err := ix.Check(); err != nil {
		t.Fatal(err)
	}
}

// heldIndex returns an index over two mounts with n entries held by the
// restart hold on the first and 3 on the second.
func heldIndex(t testing.TB, n int) *Index {
	t.Helper()
	ix := NewIndex(newFakeSpace(2))
	ix.mu.Lock()
	for i := range n + 3 {
		mnt, root := 0, "/hot"
		if i >= n {
			mnt, root = 1, "/cold"
		}
		en := &Entry{FP: 1, Path: fmt.Sprintf("%s/%d", root, i), Size: 100, Keys: []string{fmt.Sprintf("key-%d", i)}, Mount: mnt}
		ix.insertLocked(en, false)
		ix.pins.holdLocked(en)
	}
	ix.mu.Unlock()
	return ix
}

// TestHeldVisitsInChunksSeeEntriesAsTheyAreThen: a visit of the restart
// hold's entries takes them by mount, in the order they were held, visits
// each with the index's lock held for writing and releases it between
// chunks, and finds an entry as it is when its chunk comes: one unindexed
// by an earlier chunk is no longer held there, and stays listed until the
// hold ends.
func TestHeldVisitsInChunksSeeEntriesAsTheyAreThen(t *testing.T) {
	n := 2*heldChunk + 3
	ix := heldIndex(t, n)
	count := func(mnt int) (visited int) {
		ix.pins.inHeldChunks(mnt, func(*Entry) { visited++ })
		return visited
	}
	if got := count(0); got != n {
		t.Fatalf("visited %d entries of mount 0, want %d", got, n)
	}
	if got := count(1); got != 3 {
		t.Fatalf("visited %d entries of mount 1, want 3", got)
	}
	order := ix.pins.heldOrder[0]
	last := order[len(order)-1] // visited in the last chunk
	visited, held, chunks := 0, 0, 0
	ix.pins.inHeldChunks(0, func(en *Entry) {
		if ix.mu.TryRLock() {
			ix.mu.RUnlock()
			t.Fatal("an entry visited without the index's write lock")
		}
		if visited%heldChunk == 0 {
			chunks++
		}
		if visited == 0 {
			ix.unindexLocked(last, false)
		}
		if en != order[visited] {
			t.Fatalf("entry %d visited out of the order held", visited)
		}
		visited++
		if en.held {
			held++
		}
	})
	if visited != n || held != n-1 || chunks != 3 {
		t.Fatalf("visited %d entries in %d chunks, %d of them held; want %d in 3, %d", visited, chunks, held, n, n-1)
	}
	if !ix.mu.TryLock() {
		t.Fatal("the index's lock is still held after the visit")
	}
	ix.mu.Unlock()
	if err := ix.Check(); err != nil {
		t.Fatal(err)
	}
}

// BenchmarkHeldChunkLift times a demotion round's lift of the hold's pins
// (demoteHeld) on a mount of 262144 held files, and reports the time per
// chunk: how long the index's write lock is held at a time.
func BenchmarkHeldChunkLift(b *testing.B) {
	const files = 256 * heldChunk
	ix := heldIndex(b, files)
	recs := make([]abi.AccessRecord, 0, files)
	for b.Loop() {
		recs = recs[:0]
		ix.pins.inHeldChunks(0, func(en *Entry) {
			if en.held && en.pins == 1 {
				en.lifted = !en.lifted
				recs = append(recs, en.Access(abi.AccessUnpin, 1))
			}
		})
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(files/heldChunk), "ns/chunk")
}
