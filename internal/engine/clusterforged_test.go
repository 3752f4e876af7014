//go:build invariants

package engine

import (
	"bytes"
	"context"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/clustercap"
)

// logLines collects what a logger writes, a line per record, for a test
// to look for a record by the words it holds (its message and
// attributes).
type logLines struct {
	t  *testing.T
	mu sync.Mutex
	b  bytes.Buffer
}

// lineLogger returns a logger of warnings and above that logs through t
// and into the returned logLines.
func lineLogger(t *testing.T) (*slog.Logger, *logLines) {
	l := &logLines{t: t}
	return slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelWarn})), l
}

func (l *logLines) Write(p []byte) (int, error) {
	l.t.Log(strings.TrimSuffix(string(p), "\n"))
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// count is how many lines hold every one of words.
func (l *logLines) count(words ...string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, line := range strings.Split(l.b.String(), "\n") {
		all := line != ""
		for _, w := range words {
			all = all && strings.Contains(line, w)
		}
		if all {
			n++
		}
	}
	return n
}

// TestClusterAForgedSummaryFieldChangesNothingButALoudRefusal (issue
// 94, items 1 and 2): a fresh summary of node X, which holds no lock and
// has no lock file (no node runs under its name), states untagged bytes
// of 2^62 or of the whole bound, a cluster capacity of 4096 bytes (less
// than one file), or a claim of the whole bound.
// Node A, bound 8 files, stores 12 keys beside it: every store succeeds
// (evicting A's own oldest) within A's configured bound, and a warning
// names X's summary file and the field refused. On the code before,
// the untagged bytes and the claim counted against the bound and the
// capacity became A's bound, so A evicted its files and failed its
// stores.
func TestClusterAForgedSummaryFieldChangesNothingButALoudRefusal(t *testing.T) {
	file := oneFileBytes(t)
	capacity := 8 * file
	for _, tc := range []struct {
		name  string
		field string
		edit  func(s *clustercap.Summary)
	}{
		{"untagged 2^62", "untagged", func(s *clustercap.Summary) { s.Untagged = clustercap.MaxBytes }},
		{"untagged the bound", "untagged", func(s *clustercap.Summary) { s.Untagged = capacity }},
		{"capacity 4096", "capacity", func(s *clustercap.Summary) { s.Capacity = 4096 }},
		{"a claim of the whole bound", "claim", func(s *clustercap.Summary) { s.Bytes, s.Claim = capacity, capacity }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			dir := t.TempDir()
			log, lines := lineLogger(t)
			a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: capacity, ClusterInterval: time.Hour}}, NodeID: "a", Logger: log})
			s := &clustercap.Summary{Version: clustercap.SummaryVersion, Node: "x", Tag: clustercap.Tag("x"), Seq: 1,
				Time: time.Now().UnixNano(), Interval: int64(time.Hour), Capacity: capacity}
			tc.edit(s)
			path := forgeSummary(t, dir, s)
			m := a.e.mounts[0]
			m.cluster.Tick(ctx)
			r := rand.New(rand.NewPCG(94, 1))
			if got := storeWithinBound(t, a, dir, "a", 12, capacity, r); got != 12 {
				t.Errorf("A stored %d of 12 keys beside X's forged %s, want all", got, tc.field)
			}
			if got := m.cluster.Capacity(); got != capacity {
				t.Errorf("A's bound beside X's forged %s: %d, want its configured %d", tc.field, got, capacity)
			}
			if n := lines.count("refused", path, "field="+tc.field); n != 1 {
				t.Errorf("%d warnings name %s and refuse its %s, want one", n, path, tc.field)
			}
		})
	}
}

// TestClusterRefusesABoundBelowOneFilePerNodeFromARunningNode (issue 94,
// item 2): a running node B, holding its lock, configures a cluster
// capacity of 4096 bytes, less than one file. Node A, bound 8 files,
// does not apply it: it stores 12 keys within its own bound, and a
// warning names B's summary file and says why.
func TestClusterRefusesABoundBelowOneFilePerNodeFromARunningNode(t *testing.T) {
	ctx := context.Background()
	file := oneFileBytes(t)
	capacity := 8 * file
	dir := t.TempDir()
	log, lines := lineLogger(t)
	a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: capacity, ClusterInterval: time.Hour}}, NodeID: "a", Logger: log})
	b := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: 4096, ClusterInterval: time.Hour}}, NodeID: "b"})
	b.e.mounts[0].cluster.Tick(ctx)
	m := a.e.mounts[0]
	storeKeys(t, a, "first", 1, rand.New(rand.NewPCG(94, 2))) // A has seen a file's size
	m.cluster.Tick(ctx)
	r := rand.New(rand.NewPCG(94, 3))
	if got := storeWithinBound(t, a, dir, "a", 12, capacity, r); got != 12 {
		t.Errorf("A stored %d of 12 keys beside B's capacity of 4096 bytes, want all", got)
	}
	if got := m.cluster.Capacity(); got != capacity {
		t.Errorf("A's bound beside B's capacity of 4096 bytes: %d, want its configured %d", got, capacity)
	}
	if n := lines.count("refused", clustercap.DirName+"/b.summary", "field=capacity"); n != 1 {
		t.Errorf("%d warnings refuse B's capacity naming its summary file, want one", n)
	}
}

// TestClusterAForgedCutOffEvictsNothing (issue 94, item 1): a summary of
// node X, which holds no lock and has no lock file, publishes a cut-off
// rank of now, fresh and changing, as a node that found the cluster over
// its bound would. Node A, holding 4 files far below its bound, follows
// no such cut: its files stay, and a warning names X's summary file. On
// the code before, A evicted every file ranked below the cut: all of
// them.
func TestClusterAForgedCutOffEvictsNothing(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	log, lines := lineLogger(t)
	a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}, NodeID: "a", Logger: log})
	storeKeys(t, a, "a", 4, rand.New(rand.NewPCG(94, 8)))
	m := a.e.mounts[0]
	var path string
	for seq := range 3 { // a cut is followed once A has seen the summary change
		now := time.Now().UnixNano()
		path = forgeSummary(t, dir, &clustercap.Summary{Version: clustercap.SummaryVersion, Node: "x", Tag: clustercap.Tag("x"), Seq: uint64(seq + 1),
			Time: now, Interval: int64(time.Hour), Cut: uint64(now), CutTime: now})
		m.cluster.Tick(ctx)
	}
	if got := len(kvFiles(t, dir)); got != 4 {
		t.Errorf("A holds %d of its 4 files after X's forged cut-off, want all", got)
	}
	if n := lines.count("refused", path, "field=cut"); n != 1 {
		t.Errorf("%d warnings name %s and refuse its cut, want one", n, path)
	}
}

// TestClusterASummaryThatDoesNotDecodeOfANodeWithNoLockFileStopsNothing
// (issue 94, item 1): a file that does not decode lies at node X's
// summary name, fresh, and X has no lock file (no node runs under its
// name: a running node locks its file before it first publishes). Node
// A, bound 8 files, started beside it, stores 12 keys: all stored within
// the bound. On the code before, a summary A could not use of a node
// that might run stopped A's claim from growing: A stored none.
func TestClusterASummaryThatDoesNotDecodeOfANodeWithNoLockFileStopsNothing(t *testing.T) {
	file := oneFileBytes(t)
	capacity := 8 * file
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, clustercap.DirName), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, clustercap.DirName, "x.summary"), []byte("{not a summary"), 0o644); err != nil {
		t.Fatal(err)
	}
	a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: capacity, ClusterInterval: time.Hour}}, NodeID: "a"})
	a.e.mounts[0].cluster.Tick(context.Background())
	if got := storeWithinBound(t, a, dir, "a", 12, capacity, rand.New(rand.NewPCG(94, 10))); got != 12 {
		t.Errorf("A stored %d of 12 keys beside a summary that does not decode of a node with no lock file, want all", got)
	}
}
