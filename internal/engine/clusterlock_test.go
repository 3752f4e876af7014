//go:build invariants

package engine

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/clustercap"
	"github.com/kvhost/kvhost/internal/engine/cluster"
	"github.com/kvhost/kvhost/internal/testlog"
)

// errorCount is a slog.Handler counting the records at level ERROR or
// above whose message holds match, passing every record on.
type errorCount struct {
	slog.Handler
	match string
	n     *atomic.Int64
}

func (l errorCount) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelError && strings.Contains(r.Message, l.match) {
		l.n.Add(1)
	}
	return l.Handler.Handle(ctx, r)
}

func (l errorCount) WithAttrs(a []slog.Attr) slog.Handler {
	return errorCount{l.Handler.WithAttrs(a), l.match, l.n}
}

// errorLogger logs through t and counts the ERROR lines holding match.
func errorLogger(t *testing.T, match string) (*slog.Logger, *atomic.Int64) {
	n := &atomic.Int64{}
	h := slog.NewTextHandler(testlog.Writer(t), &slog.HandlerOptions{Level: slog.LevelInfo})
	return slog.New(errorCount{h, match, n}), n
}

// TestClusterSaysNothingOfFlocksAboutANodeThatRestartsBetweenProbes
// (issue 85, defect 8): node L crash-loops: each run takes its lock,
// publishes a few summaries (a few more each run, its sequence starting
// again at 1) and dies, and node A's probes find L's lock free while L
// is down, its summary still fresh and grown since the last probe. A lock
// free between two runs says nothing of whether flocks reach between the
// nodes (on CephFS they do): A must not log the ERROR that they do not.
func TestClusterSaysNothingOfFlocksAboutANodeThatRestartsBetweenProbes(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	log, unshared := errorLogger(t, "flocks do not reach between the two nodes")
	a := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}, NodeID: "a", Logger: log})
	for run := range 2 * cluster.UnsharedProbes {
		l, err := clustercap.OpenDir(fsys.OS{}, dir, "l")
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now().UnixNano()
		for seq := range run + 2 {
			if err := l.Publish(&clustercap.Summary{Version: clustercap.SummaryVersion, Node: "l", Tag: clustercap.Tag("l"), Seq: uint64(seq + 1),
				Time: time.Now().UnixNano(), Interval: int64(time.Hour), Run: start}); err != nil {
				t.Fatal(err)
			}
		}
		if err := l.Close(); err != nil { // L dies: its lock free, its summary fresh
			t.Fatal(err)
		}
		a.e.mounts[0].cluster.Tick(ctx)
	}
	if n := unshared.Load(); n != 0 {
		t.Errorf("A logged %d ERRORs that flocks do not reach L, whose lock it found free only between L's runs", n)
	}
}

// TestClusterSaysNoSecondCopyRunsWhenAProbeHoldsItsLockAMoment (issue
// 85, defect 8): node X's cluster directory goes away and comes back as
// a copy (its lock file a new file, which X does not hold), and another
// node, reading X's copied summary stale, probes X's lock at X's next
// tick, holding it for that moment. X must not log the ERROR that a
// second copy of itself runs: at its next tick it holds its lock again.
func TestClusterSaysNoSecondCopyRunsWhenAProbeHoldsItsLockAMoment(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	log, copies := errorLogger(t, "") // any ERROR
	x := clusterNodeOf(t, Config{Mounts: []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}, NodeID: "x", Logger: log})
	m := x.e.mounts[0]
	cdir := filepath.Join(dir, clustercap.DirName)
	if err := os.Rename(cdir, cdir+".away"); err != nil {
		t.Fatal(err)
	}
	m.cluster.Tick(ctx) // the directory is gone
	if err := os.Mkdir(cdir, 0o755); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(cdir + ".away")
	if err != nil {
		t.Fatal(err)
	}
	for _, ent := range ents { // it comes back as a copy
		b, err := os.ReadFile(filepath.Join(cdir+".away", ent.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(cdir, ent.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	probe, err := os.OpenFile(filepath.Join(cdir, "x.lock"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(probe.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	m.cluster.Tick(ctx) // another node's probe holds X's lock
	probe.Close()
	m.cluster.Tick(ctx)
	if n := copies.Load(); n != 0 {
		t.Errorf("X logged %d ERRORs (a second copy of it running, another node of its tag) where another node's probe held its lock for a tick", n)
	}
	other, err := clustercap.OpenDir(fsys.OS{}, dir, "other")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if free, err := other.LockFree("x"); err != nil || free {
		t.Errorf("X runs, its directory back: another node finds its lock free: %v, %v", free, err)
	}
}
