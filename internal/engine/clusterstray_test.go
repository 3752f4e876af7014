//go:build invariants

package engine

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/clustercap"
)

// TestClusterAStraySummaryDoesNotFoolTheFlockDiagnosis (issue 94, item
// 6): beside a running node P, with which node A finds flocks shared, a
// summary of node X, which runs nowhere, is rewritten before each of A's
// ticks, fresh and growing, as a forger (or a stray copy of a node's
// directory) may: once with no lock file of X's, once with one that no
// process holds. A's probes find X's lock free while its summary grows,
// which on the code before A logged as the error that flocks do not
// reach between the nodes ("an NFS mount with local_lock…?"), false on
// a mount where they reach P. Now A logs no such error, and one warning
// names X's summary file as a summary whose node does not hold its lock.
func TestClusterAStraySummaryDoesNotFoolTheFlockDiagnosis(t *testing.T) {
	for _, lockFile := range []bool{false, true} {
		name := "no lock file"
		if lockFile {
			name = "a lock file no process holds"
		}
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			dir := t.TempDir()
			log, lines := lineLogger(t)
			mnt := []Mount{{Path: dir, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}}
			p := clusterNodeOf(t, Config{Mounts: mnt, NodeID: "p"})
			p.e.mounts[0].cluster.Tick(ctx)
			a := clusterNodeOf(t, Config{Mounts: mnt, NodeID: "a", Logger: log})
			m := a.e.mounts[0]
			if lockFile {
				if err := os.WriteFile(filepath.Join(dir, clustercap.DirName, "x.lock"), nil, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			run := time.Now().UnixNano()
			var path string
			for i := range 2 * 3 { // well past the probes that make the diagnosis (cluster.UnsharedProbes)
				path = forgeSummary(t, dir, &clustercap.Summary{Version: clustercap.SummaryVersion, Node: "x", Tag: clustercap.Tag("x"), Seq: uint64(i + 1),
					Time: time.Now().UnixNano(), Interval: int64(time.Hour), Run: run, Bytes: int64(i), Claim: int64(i)})
				m.cluster.Tick(ctx)
			}
			if v := m.cluster.Inspect(); len(v.Shared) == 0 {
				t.Fatalf("A found flocks shared with no node beside running P: %+v", v)
			}
			if n := lines.count("flocks do not reach"); n != 0 {
				t.Errorf("%d errors say flocks do not reach between the nodes, where they reach P; want none", n)
			}
			if n := lines.count("does not hold its lock", path); n != 1 {
				t.Errorf("%d warnings name %s as a summary whose node does not hold its lock, want one", n, path)
			}
		})
	}
}
