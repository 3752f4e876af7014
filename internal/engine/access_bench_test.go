//go:build invariants

package engine

import (
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
)

// BenchmarkAccessJournal measures what the access journal (access.go)
// costs, on the directory named by KVHOST_BENCH_DIR (see bench_test.go):
//
//	go test -run '^$' -bench AccessJournal ./internal/engine
//
// Each iteration reports 1,024 hits, one per file, as lookups do: note,
// on the path of the call that reports them (Engine.access), and the
// write, on the hit recorder's goroutine (ns/op times both, and the
// benchmark's own journal compacts as the engine's would). Its
// ceiling, timed in the same iteration with the timer stopped, is a
// plain open, append of the same bytes and close of a file beside the
// journal. Reported: ns per hit noted (note-ns/hit), ns per hit noted
// and written (ns/hit), journal/ceiling, and ns per store's note
// (store-ns: a store's INSERT, which the journal ignores, is all it
// adds to a store).
func BenchmarkAccessJournal(b *testing.B) {
	const files = 1024
	ctx := context.Background()
	dir := filepath.Join(benchDir(b), "mount")
	e := openEngine(b, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, abi.OrderLayerMajor)})
	g := smallGeometry(true)
	ns, err := e.Declare(ctx, g)
	if err != nil {
		b.Fatal(err)
	}
	c := newTestCache(b, e, ns, g, 64, layoutBlockFirst)
	r := rand.New(rand.NewPCG(2, 2))
	c.fill(r, []int{0, 1, 2, 3})
	keys := testKeys("bench-acc", files)
	for i := 0; i < files; i += 64 {
		blocks := make([][]int, 64)
		for k := range blocks {
			blocks[k] = []int{0, 1, 2, 3}
		}
		storeAndCheck(b, e, c, keys[i:i+64], blocks)
	}
	ens := make([]*entry, files)
	for i, k := range keys {
		ens[i] = e.find(e.tables.get(ns), k)
	}
	// A journal of its own beside the engine's, which its hit recorder
	// writes: this one only the benchmark does.
	a := newAccessLog(e.ix, e.fs, testLogger(b), []string{journalPath(dir, "bench")})
	ceiling := filepath.Join(dir, ".ceiling")
	bytes := make([]byte, files*24)
	store := []abi.AccessRecord{ens[0].Access(abi.AccessInsert, 1)}
	var noted, journaled, walled, stored time.Duration
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		recs := e.ix.Pins().Hit(ens, time.Now().UnixNano())
		b.StartTimer()
		t0 := time.Now()
		a.note(recs)
		noted += time.Since(t0)
		a.write()
		journaled += time.Since(t0)
		b.StopTimer()
		t1 := time.Now()
		f, err := os.OpenFile(ceiling, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := f.Write(bytes); err != nil {
			b.Fatal(err)
		}
		f.Close()
		walled += time.Since(t1)
		t2 := time.Now()
		a.note(store)
		stored += time.Since(t2)
		b.StartTimer()
	}
	b.StopTimer()
	n := float64(b.N)
	b.ReportMetric(float64(journaled.Nanoseconds())/n/files, "ns/hit")
	b.ReportMetric(float64(noted.Nanoseconds())/n/files, "note-ns/hit")
	b.ReportMetric(float64(journaled.Nanoseconds())/float64(walled.Nanoseconds()), "journal/ceiling")
	b.ReportMetric(float64(stored.Nanoseconds())/n, "store-ns")
}
