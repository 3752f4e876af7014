package fsys

import (
	"runtime"
	"sync"
	"testing"
	"time"
)

func TestInFlightOldestIsTheEarliestCallNotEnded(t *testing.T) {
	for _, n := range []int{1, 3, inFlightSlots, 3 * inFlightSlots} { // beyond the slots: the map
		var w InFlight
		if got := w.Oldest(); !got.IsZero() {
			t.Fatalf("Oldest with no call = %v, want zero", got)
		}
		before := time.Now()
		calls := make([]Call, n)
		for i := range calls {
			calls[i] = w.Begin()
		}
		after := time.Now()
		first := w.Oldest()
		if first.Before(before) || first.After(after) {
			t.Fatalf("%d calls: Oldest = %v, want within [%v, %v]", n, first, before, after)
		}
		// Ending every call but the last leaves the last's start.
		last := calls[n-1]
		for _, c := range calls[:n-1] {
			w.End(c)
		}
		if got := w.Oldest(); got.Before(first) || got.After(after) {
			t.Fatalf("%d calls, all but the last ended: Oldest = %v, want within [%v, %v]", n, got, first, after)
		}
		w.End(last)
		if got := w.Oldest(); !got.IsZero() {
			t.Fatalf("%d calls, all ended: Oldest = %v, want zero", n, got)
		}
	}
}

func TestInFlightKeepsAHeldCallAmongManyEnding(t *testing.T) {
	var w InFlight
	held := w.Begin()
	began := w.Oldest()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 10000 {
				w.End(w.Begin())
			}
		})
	}
	wg.Wait()
	if got := w.Oldest(); !got.Equal(began) {
		t.Fatalf("Oldest = %v after 80000 calls beside the held one, want its start %v", got, began)
	}
	w.End(held)
	if got := w.Oldest(); !got.IsZero() {
		t.Fatalf("Oldest = %v with every call ended, want zero", got)
	}
}

// BenchmarkInFlight times one Begin and End pair, the cost Watched adds
// to each file operation, and reports it against the copy of a 256 KiB
// piece (what one read or write of the movers moves) timed in the same
// run: of-piece is the pair's time over the copy's.
func BenchmarkInFlight(b *testing.B) {
	src, dst := make([]byte, 256<<10), make([]byte, 256<<10)
	const copies = 200
	t0 := time.Now()
	for range copies {
		copy(dst, src)
	}
	piece := time.Since(t0) / copies
	var w InFlight
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			w.End(w.Begin())
		}
	})
	b.StopTimer()
	// RunParallel's goroutines keep every processor busy: a pair's
	// processor time is the wall time per pair times the processors
	// they ran on.
	cpus := min(runtime.GOMAXPROCS(0), runtime.NumCPU())
	perPair := b.Elapsed() * time.Duration(cpus) / time.Duration(max(b.N, 1))
	b.ReportMetric(float64(piece.Nanoseconds()), "piece-ns")
	b.ReportMetric(float64(perPair)/float64(piece), "of-piece")
}

// TestInFlightTakesNoLockUntilEverySlotIsTaken: 64 calls at once all get
// a slot; the 65th goes to the map.
func TestInFlightTakesNoLockUntilEverySlotIsTaken(t *testing.T) {
	var w InFlight
	calls := make([]Call, inFlightSlots+1)
	for i := range inFlightSlots {
		calls[i] = w.Begin()
		if calls[i].slot == 0 {
			t.Fatalf("call %d of %d went to the map with slots free", i+1, inFlightSlots)
		}
	}
	calls[inFlightSlots] = w.Begin()
	if calls[inFlightSlots].slot != 0 || len(w.more) != 1 {
		t.Fatalf("call %d with every slot taken: slot %d, %d in the map", inFlightSlots+1, calls[inFlightSlots].slot, len(w.more))
	}
	for _, c := range calls {
		w.End(c)
	}
	if got := w.Oldest(); !got.IsZero() {
		t.Fatalf("Oldest = %v with every call ended", got)
	}
}
