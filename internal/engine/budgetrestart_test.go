//go:build invariants

package engine

import (
	"context"
	"encoding/json"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/plugins/lru"
)

// TestABudgetFloorHoldsAcrossARestartBeforeItsClientDeclaresAgain: a
// quiet namespace with a floor stored its files, then the engine
// restarted; a busy namespace stores past the mount's capacity before
// the quiet one's client declares it again. The quiet namespace keeps
// its floor: the model book told the restarted engine which files are
// its, and Open said so in its log. Before the books, its files counted
// toward no budget until its client came back, and the busy one's
// evictions took them all (issue 94: 120 files, a 3 MiB floor). With
// the book gone (files from before the books), the floor cannot hold,
// and Open warns that it does not.
func TestABudgetFloorHoldsAcrossARestartBeforeItsClientDeclaresAgain(t *testing.T) {
	const (
		mountFiles = 30
		quietKeys  = 10
		busyKeys   = 40
	)
	for _, tc := range []struct {
		name      string
		lose      bool // the model book removed before the restart
		wantKept  int  // the quiet namespace's files left, at least
		wantLog   string
		wantLevel string
	}{
		{name: "with its model book", wantKept: quietKeys,
			wantLog: "engine: budgets count the files found from the start: their namespaces' model ids read from the model books", wantLevel: "INFO"},
		{name: "its model book lost", lose: true,
			wantLog: "engine: budget floors: files found of namespaces no model book names count toward no budget until their clients declare them; a floor does not protect them meanwhile", wantLevel: "WARN"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			g := smallGeometry(true)
			fileLen := int64(4096) + g.KeyBytes()
			dir := t.TempDir()
			newLRU := func(idx policy.Index) (policy.Policy, error) {
				return policy.NewNative(func() guest.Policy { return lru.New() }, idx, policy.Config{Shards: 1, Logger: testLogger(t)})
			}
			var logs lockedBuffer
			cfg := Config{
				Mounts:    []Mount{{Path: dir, Capacity: mountFiles * fileLen, HighWatermark: 0.9, LowWatermark: 0.8}},
				NewPolicy: newLRU,
				NoReuse:   true,
				NodeID:    "n1",
				Budgets:   []Budget{{Model: "tenant/quiet", Floor: quietKeys * fileLen}},
			}
			r := rand.New(rand.NewPCG(9, 4))
			store := func(e *Engine, model, prefix string, n int) {
				_, c := storeAsModel(t, e, g, model, testKeys(prefix, n), r)
				if err := e.UnregisterCache(c.id); err != nil {
					t.Fatal(err)
				}
			}
			e := openEngine(t, cfg)
			store(e, "tenant/quiet", "quiet", quietKeys)
			quiet := g
			quiet.Model = "tenant/quiet"
			if err := e.Close(ctx); err != nil {
				t.Fatal(err)
			}
			if tc.lose {
				if err := os.Remove(filepath.Join(dir, modelBookPrefix+"n1")); err != nil {
					t.Fatal(err)
				}
			}

			cfg.Logger = slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
			e = openEngine(t, cfg)
			if got := e.ix.Counts().ByFingerprint()[quiet.Fingerprint()].Files; got != quietKeys {
				t.Fatalf("the restart found %d files of the quiet namespace, want %d", got, quietKeys)
			}
			wantBudget := "tenant/quiet"
			if tc.lose {
				wantBudget = ""
			}
			for _, ns := range e.Stats().Namespaces {
				if ns.Fingerprint == quiet.Fingerprint() && (ns.Budget != wantBudget || ns.Model != "") {
					t.Errorf("the quiet namespace found at start is listed %+v, want budget %q and no model id", ns, wantBudget)
				}
			}
			store(e, "tenant/busy", "busy", busyKeys) // the quiet namespace's client not back yet
			kept := e.ix.Counts().ByFingerprint()[quiet.Fingerprint()].Files
			if kept < tc.wantKept {
				t.Errorf("the quiet namespace kept %d of its %d files (floor %d files) before its client declared it again", kept, quietKeys, quietKeys)
			}
			if recs := logs.records(t, tc.wantLog); len(recs) != 1 || recs[0]["level"] != tc.wantLevel {
				t.Errorf("log records %v of %q; want one, %s", recs, tc.wantLog, tc.wantLevel)
			}
			// Its client back: the book names it once, as before.
			store(e, "tenant/quiet", "back", 1)
			if st := budgetOf(t, e.Stats(), "tenant/quiet"); st.Bytes < int64(min(kept+1, quietKeys))*fileLen {
				t.Errorf("the quiet budget counts %d bytes, want its %d files", st.Bytes, min(kept+1, quietKeys))
			}
		})
	}
}

// TestAModelBookLineCountsOnlyForTheFingerprintItsGeometryHashesTo: a
// book's line names the model id of the fingerprint its geometry hashes
// to, whatever else it says; a line that does not decode, or whose
// geometry does not validate, is skipped and counted, and a line torn
// by a crash does not cost the line appended after it.
func TestAModelBookLineCountsOnlyForTheFingerprintItsGeometryHashesTo(t *testing.T) {
	g := smallGeometry(true)
	g.Model = "tenant/a"
	other := g
	other.Model = "tenant/b"
	zero := g
	zero.Layers = 0
	line := func(v any) string {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	forged := strings.Replace(line(g), "{", `{"Fingerprint":12345,`, 1)
	path := filepath.Join(t.TempDir(), modelBookPrefix+"n")
	body := forged + "\nnot json\n" + line(zero) + "\n" + `{"Model":"torn`
	if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := appendLine(fsys.OS{}, path, []byte(line(other)+"\n")); err != nil {
		t.Fatal(err)
	}
	geos, bad, err := readModelBook(fsys.OS{}, path)
	if err != nil {
		t.Fatal(err)
	}
	want := map[uint64]Geometry{g.Fingerprint(): g, other.Fingerprint(): other}
	if !maps.Equal(geos, want) || bad != 3 {
		t.Fatalf("book read as %v with %d lines skipped; want %v and 3 (not json, a zero-layer geometry, the torn line)", geos, bad, want)
	}
}
