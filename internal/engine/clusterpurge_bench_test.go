//go:build invariants

package engine

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/clustercap"
)

// BenchmarkClusterTickScans compares, on an index of 1M entries of a
// cluster mount (this node's own files, all of a namespace purged before
// they were written), the tick's scans under the index's read lock:
// count's, which every tick makes, and applyPurges', which a tick makes
// once a purge record of a namespace it indexes files of exists (none:
// no scan; a record of a namespace that has no entry: no scan either; a
// record of the entries' namespace older than them: the whole scan). The entries are planted in the index's map alone, and taken out
// before the engine closes.
func BenchmarkClusterTickScans(b *testing.B) {
	const entries = 1_000_000
	ctx := context.Background()
	e := openEngine(b, Config{Mounts: []Mount{{Path: b.TempDir(), ClusterCapacity: 1 << 40, ClusterInterval: time.Hour}}, NodeID: "bench",
		Policy: newTestPolicy(1, 0)})
	m := e.mounts[0]
	c := m.cluster
	const fp = 0x1234
	now := time.Now().UnixNano()
	var i int64
	// counted in byFP, as applyPurges asks it
	b.Cleanup(e.ix.Files().AddUnlinked(fp, func(uint64) *entry {
		en := &entry{FP: fp, Mount: m.idx, Size: 1 << 20, FID: clustercap.FileID(c.Tag(), rand.Uint64()),
			Last: now + i, Keys: []string{fmt.Sprint(i)}}
		en.Ident.Mtime = now + i
		i++
		return en
	}, entries))
	b.Run("count", func(b *testing.B) {
		for b.Loop() {
			c.Count(ctx)
		}
	})
	b.Run("applyPurges-no-record", func(b *testing.B) {
		for b.Loop() {
			c.ApplyPurges(ctx)
		}
	})
	purgeRecordAt(b, c, 0x5678, now)
	b.Run("applyPurges-record-of-another-namespace", func(b *testing.B) {
		for b.Loop() {
			c.ApplyPurges(ctx)
		}
	})
	b.Run("applyPurges-older-record-of-the-namespace", func(b *testing.B) {
		purgeRecordAt(b, c, fp, now-1)
		for b.Loop() {
			c.ApplyPurges(ctx)
		}
	})
}

// purgeRecordAt puts a purge record of fp at time t in c's directory and
// has c read it.
func purgeRecordAt(b *testing.B, c *clusterMount, fp uint64, t int64) {
	b.Helper()
	if err := os.WriteFile(filepath.Join(c.Dir().Path(), fmt.Sprintf("%016x-%d.purge", fp, t)), nil, 0o644); err != nil {
		b.Fatal(err)
	}
	if _, _, err := c.Dir().ReadAll(); err != nil {
		b.Fatal(err)
	}
	if got, ok := c.Dir().PurgedAt(fp, t); !ok || got != t {
		b.Fatalf("record of %016x at %d read as %d (%v)", fp, t, got, ok)
	}
}
