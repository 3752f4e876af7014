package clustercap

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/fsys"
)

// benchDirsEnv names the variable that lists client mounts of one shared
// directory (a:b:c, as the multi-node suite's KVHOST_CLUSTER_MOUNTS) for
// the coordination benchmarks; without it they measure a local temporary
// directory.
const benchDirsEnv = "KVHOST_CLUSTER_MOUNTS"

// benchDirs returns three paths of one fresh directory, through the
// client mounts of benchDirsEnv or a local temporary directory.
func benchDirs(b *testing.B) []string {
	b.Helper()
	v := os.Getenv(benchDirsEnv)
	if v == "" {
		d := b.TempDir()
		return []string{d, d, d}
	}
	mounts := strings.Split(v, ":")
	if len(mounts) < 3 {
		b.Fatalf("%s=%q: want 3 mounts", benchDirsEnv, v)
	}
	sub := fmt.Sprintf("clustercap-bench-%d", time.Now().UnixNano())
	if err := os.Mkdir(mounts[0]+"/"+sub, 0o755); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(mounts[0] + "/" + sub) })
	out := make([]string, 3)
	for i := range out {
		out[i] = mounts[i] + "/" + sub
	}
	return out
}

// benchSummary is a node's summary as a busy node publishes it: a full
// sketch of 10,000 files and 64 touches.
func benchSummary(node string, seq uint64) *Summary {
	items := make([]Item, 10_000)
	base := uint64(1_700_000_000_000_000_000)
	for i := range items {
		items[i] = Item{Rank: base + uint64(i)*1_000_003, Bytes: 2 << 20}
	}
	s := &Summary{Version: SummaryVersion, Node: node, Tag: Tag(node), Seq: seq, Time: time.Now().UnixNano(),
		Interval: int64(time.Second), Bytes: 10_000 * 2 << 20, Claim: 10_001 * 2 << 20, Sketch: NewSketch(items, SketchPoints)}
	for i := range 64 {
		s.Touches = append(s.Touches, Touch{ID: FileID(Tag("other"), uint64(i)+1), Rank: base + uint64(i), Time: int64(base) + int64(i)})
	}
	return s
}

// reportLatency reports the p50, p99 and max of ds as metrics.
func reportLatency(b *testing.B, ds []time.Duration) {
	b.Helper()
	if len(ds) == 0 {
		return
	}
	slices.Sort(ds)
	at := func(p int) time.Duration { return ds[max((len(ds)*p+99)/100, 1)-1] }
	b.ReportMetric(float64(at(50).Microseconds()), "p50-µs")
	b.ReportMetric(float64(at(99).Microseconds()), "p99-µs")
	b.ReportMetric(float64(ds[len(ds)-1].Microseconds()), "max-µs")
}

// otherNodes opens a Dir for each name on dirs[first+i%len] (the other
// client mounts), publishes its first summary, and calls each(o, s) every
// period until the returned stop is called; stop waits for them.
func otherNodes(b *testing.B, dirs []string, first int, names []string, period time.Duration, each func(o *Dir, s *Summary)) (stop func()) {
	b.Helper()
	done := make(chan struct{})
	var wg sync.WaitGroup
	for i, name := range names {
		o, err := OpenDir(fsys.OS{}, dirs[first+i%(len(dirs)-first)], name)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { o.Close() })
		s := benchSummary(name, 1)
		if err := o.Publish(s); err != nil {
			b.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-done:
					return
				case <-time.After(period):
					each(o, s)
				}
			}
		}()
	}
	return func() { close(done); wg.Wait() }
}

// BenchmarkSummaryPublish measures one node's summary publication (write a
// temporary file, rename it over the last summary) while two other nodes,
// through the other client mounts, read every summary every 10 ms.
func BenchmarkSummaryPublish(b *testing.B) {
	dirs := benchDirs(b)
	d, err := OpenDir(fsys.OS{}, dirs[0], "n1")
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	stop := otherNodes(b, dirs, 1, []string{"n2", "n3"}, 10*time.Millisecond, func(o *Dir, _ *Summary) { o.ReadAll() })
	s := benchSummary("n1", 0)
	enc, _ := json.Marshal(s)
	b.SetBytes(int64(len(enc)))
	ds := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := range b.N {
		s.Seq = uint64(i + 1)
		start := time.Now()
		if err := d.Publish(s); err != nil {
			b.Fatal(err)
		}
		ds = append(ds, time.Since(start))
	}
	b.StopTimer()
	stop()
	reportLatency(b, ds)
}

// BenchmarkSummaryReadAll measures one node reading three other nodes'
// summaries while those nodes, through the other client mounts, publish
// theirs every 100 ms (renames over the files being read).
func BenchmarkSummaryReadAll(b *testing.B) {
	dirs := benchDirs(b)
	d, err := OpenDir(fsys.OS{}, dirs[0], "n0")
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	stop := otherNodes(b, dirs, 1, []string{"n1", "n2", "n3"}, 100*time.Millisecond, func(o *Dir, s *Summary) {
		s.Seq++
		o.Publish(s)
	})
	ds := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		sums, bad, err := d.ReadAll()
		if err != nil {
			b.Fatal(err)
		}
		if len(sums) != 3 || len(bad) > 0 {
			b.Fatalf("read %d summaries (%v), want 3", len(sums), bad)
		}
		ds = append(ds, time.Since(start))
	}
	b.StopTimer()
	stop()
	reportLatency(b, ds)
}
