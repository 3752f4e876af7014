//go:build invariants

package engine

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/engine/accesslog"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/plugins/lfu"
	"github.com/kvhost/kvhost/plugins/lru"
	"github.com/kvhost/kvhost/plugins/sharded"
	"github.com/kvhost/kvhost/plugins/tiered"
	"github.com/kvhost/kvhost/plugins/ttl"
)

// accessFixture is a directory whose files engines store, use and find
// again after a restart, on one test clock that only moves forward.
type accessFixture struct {
	t      *testing.T
	dir    string
	g      Geometry
	keys   [][]byte
	blocks [][]int
	mu     sync.Mutex
	now    time.Time
}

// accessSession is one engine's run over the fixture's directory.
type accessSession struct {
	e   *Engine
	pol *testPolicy
	ns  NamespaceID
	c   *testCache
}

func newAccessFixture(t *testing.T, keys int) *accessFixture {
	r := rand.New(rand.NewPCG(8, 5))
	// Hours after the files' mtimes (the wall clock): a use's time is
	// never taken for a store time.
	return &accessFixture{t: t, dir: t.TempDir(), g: smallGeometry(true), keys: testKeys("acc", keys),
		blocks: blockLists(r, keys, 4, 0), now: time.Now().Add(3 * time.Hour)}
}

func (f *accessFixture) clock() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now = f.now.Add(time.Millisecond)
	return f.now
}

// open opens an engine on the directory as node, with a testPolicy.
func (f *accessFixture) open(node string) *accessSession {
	f.t.Helper()
	pol := newTestPolicy(1, abi.OrderLayerMajor)
	s := f.openWith(node, Config{Policy: pol})
	s.pol = pol
	return s
}

// openWith opens an engine on the directory as node, with cfg's policy.
func (f *accessFixture) openWith(node string, cfg Config) *accessSession {
	f.t.Helper()
	s := &accessSession{}
	cfg.Mounts, cfg.Now, cfg.NodeID = []Mount{{Path: f.dir}}, f.clock, node
	s.e = openEngine(f.t, cfg)
	var err error
	if s.ns, err = s.e.Declare(context.Background(), f.g); err != nil {
		f.t.Fatal(err)
	}
	s.c = newTestCache(f.t, s.e, s.ns, f.g, 64, layoutBlockFirst)
	r := rand.New(rand.NewPCG(1, 2))
	for _, b := range f.blocks {
		s.c.fill(r, b)
	}
	return s
}

func (s *accessSession) close(t *testing.T) {
	t.Helper()
	if err := s.e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// hit looks key up times times and returns the time of the last hit.
func (s *accessSession) hit(t *testing.T, key []byte, times int) int64 {
	t.Helper()
	for range times {
		if n, err := s.e.Lookup(context.Background(), s.ns, [][]byte{key}); err != nil || n != 1 {
			t.Fatalf("lookup of %q = %d, %v; want a hit", key, n, err)
		}
	}
	s.e.pol.hitRec.flush()
	return s.e.find(s.e.tables.get(s.ns), key).Last
}

// restored returns the RESTORE record the policy got at Open for key.
func (s *accessSession) restored(t *testing.T, key []byte) abi.AccessRecord {
	t.Helper()
	s.pol.mu.Lock()
	defer s.pol.mu.Unlock()
	kh := abi.KeyHash(key)
	for _, r := range s.pol.entries {
		if r.KeyHash == kh {
			if r.Kind != abi.AccessRestore {
				t.Fatalf("key %q: the policy's record is of kind %d, want RESTORE", key, r.Kind)
			}
			return *r
		}
	}
	t.Fatalf("key %q: no RESTORE record", key)
	return abi.AccessRecord{}
}

// mtime is the modification time of key's file, what a RESTORE carried
// before the journal.
func (s *accessSession) mtime(t *testing.T, key []byte) int64 {
	t.Helper()
	_, paths, _, _ := s.e.nm.names(context.Background(), s.e.tables.get(s.ns), [][]byte{key})
	fi, err := os.Stat(paths[0])
	if err != nil {
		t.Fatal(err)
	}
	return fi.ModTime().UnixNano()
}

func wantRestored(t *testing.T, what string, got abi.AccessRecord, at int64, hits uint32) {
	t.Helper()
	if int64(got.Time) != at || got.Hits != hits {
		t.Errorf("%s: RESTORE carried time %d, hits %d; want time %d, hits %d", what, got.Time, got.Hits, at, hits)
	}
}

// The contract of docs/abi.md: a RESTORE carries the file's last access
// and the hits the host knows of. Before the access journal a restarted
// engine sent the store time (the mtime) and 0 hits.
func TestRestoreCarriesTheLastHitAndHitCountAfterARestart(t *testing.T) {
	f := newAccessFixture(t, 3)
	s := f.open("n1")
	storeAndCheck(t, s.e, s.c, f.keys, f.blocks)
	hit0 := s.hit(t, f.keys[0], 2)
	hit1 := s.hit(t, f.keys[1], 1)
	hit0 = max(hit0, s.hit(t, f.keys[0], 1)) // three hits, the last after key 1's
	s.close(t)

	s = f.open("n1")
	wantRestored(t, "key 0, hit 3 times", s.restored(t, f.keys[0]), hit0, 3)
	wantRestored(t, "key 1, hit once", s.restored(t, f.keys[1]), hit1, 1)
	wantRestored(t, "key 2, never hit", s.restored(t, f.keys[2]), s.mtime(t, f.keys[2]), 0)
	// A use after the restart adds to what was restored.
	hit1 = s.hit(t, f.keys[1], 1)
	s.close(t)
	s = f.open("n1")
	wantRestored(t, "key 1 after a second restart", s.restored(t, f.keys[1]), hit1, 2)
	s.close(t)

	// Files from before the journal (none on the mount) restore as they
	// did: their store time, no hits.
	if err := os.Remove(filepath.Join(f.dir, accesslog.Prefix+"n1")); err != nil {
		t.Fatal(err)
	}
	s = f.open("n1")
	for i, k := range f.keys {
		wantRestored(t, "a key without a journal "+string(rune('0'+i)), s.restored(t, k), s.mtime(t, k), 0)
	}
}

// A crash mid-append leaves a torn record at the journal's end, and a
// record may be garbled: neither gives any file figures, the records
// before them still count, and the next engine's appends go over the
// torn bytes, where they are read back.
func TestRestoreAfterATornJournalLosesOnlyTheLatestUpdates(t *testing.T) {
	f := newAccessFixture(t, 3)
	s := f.open("n1")
	storeAndCheck(t, s.e, s.c, f.keys, f.blocks)
	hit0 := s.hit(t, f.keys[0], 2)
	fid := func(k []byte) uint64 { return s.e.find(s.e.tables.get(s.ns), k).FID }
	fid0, fid1, fid2 := fid(f.keys[0]), fid(f.keys[1]), fid(f.keys[2])
	s.close(t)

	path := filepath.Join(f.dir, accesslog.Prefix+"n1")
	j, err := accesslog.Open(s.e.fs, path)
	if err != nil {
		t.Fatal(err)
	}
	far := f.clock().UnixNano()
	// A record of key 1 garbled (its hits' bytes changed after its
	// checksum), a valid one of a file no one has, one of key 0 garbled
	// too, then one of key 2 cut short by a crash.
	if err := j.Append([]accesslog.Figure{{FID: fid1, Last: far, Hits: 7}, {FID: 0x5eed, Last: far, Hits: 9},
		{FID: fid0, Last: far, Hits: 99}, {FID: fid2, Last: far, Hits: 99}}); err != nil {
		t.Fatal(err)
	}
	j.Close()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	end := len(b) - 4*accesslog.RecordSize
	b[end+16] ^= 0xff                    // key 1's hits
	b[end+2*accesslog.RecordSize+3] ^= 1 // key 0's file id: its checksum fails
	b = b[:len(b)-11]                    // key 2's record torn
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}

	s = f.open("n1")
	wantRestored(t, "key 0 (last good record: 2 hits)", s.restored(t, f.keys[0]), hit0, 2)
	wantRestored(t, "key 1 (only a garbled record)", s.restored(t, f.keys[1]), s.mtime(t, f.keys[1]), 0)
	wantRestored(t, "key 2 (only a torn record)", s.restored(t, f.keys[2]), s.mtime(t, f.keys[2]), 0)
	hit2 := s.hit(t, f.keys[2], 1)
	s.close(t)
	s = f.open("n1")
	wantRestored(t, "key 2, hit after the torn record", s.restored(t, f.keys[2]), hit2, 1)
	wantRestored(t, "key 0 again", s.restored(t, f.keys[0]), hit0, 2)
}

// A journal names files by their header ids: a file another node wrote
// in the place of one this node used restores with its own figures, not
// the old file's.
func TestRestoreOfAFileReplacedByAnotherNodeCarriesTheNewFilesFigures(t *testing.T) {
	f := newAccessFixture(t, 2)
	s := f.open("n1")
	storeAndCheck(t, s.e, s.c, f.keys, f.blocks)
	s.hit(t, f.keys[0], 4)
	old := s.e.find(s.e.tables.get(s.ns), f.keys[0]).FID
	s.close(t)

	other := f.open("n2")
	if n, err := other.e.Delete(context.Background(), other.ns, f.keys[:1]); err != nil || n != 1 {
		t.Fatalf("the other node's Delete = %d, %v; want 1", n, err)
	}
	storeAndCheck(t, other.e, other.c, f.keys[:1], f.blocks[:1])
	if now := other.e.find(other.e.tables.get(other.ns), f.keys[0]).FID; now == old {
		t.Fatal("the new file has the old one's id: the test proves nothing")
	}
	other.close(t)

	s = f.open("n1")
	wantRestored(t, "key 0 rewritten by another node", s.restored(t, f.keys[0]), s.mtime(t, f.keys[0]), 0)
}

// The symptom: a restarted node's hot files ranked lowest, the
// first its policy evicted. The oldest file, hit before the restart, is
// the last victim each built-in policy offers after it, not the first.
func TestAFileHitBeforeARestartIsNotTheFirstVictimOfTheBuiltinPolicies(t *testing.T) {
	policies := []struct {
		name string
		new  func() guest.Policy
	}{
		{"lru", func() guest.Policy { return lru.New() }},
		{"lfu", func() guest.Policy { return lfu.New() }},
		{"ttl", func() guest.Policy { return ttl.New() }},
		{"sharded", func() guest.Policy { return sharded.New() }},
		{"tiered", func() guest.Policy { return tiered.New() }},
	}
	for _, p := range policies {
		t.Run(p.name, func(t *testing.T) {
			ctx := context.Background()
			cfg := Config{NewPolicy: func(idx policy.Index) (policy.Policy, error) {
				return policy.NewNative(p.new, idx, policy.Config{Shards: 1, Logger: testLogger(t)})
			}}
			f := newAccessFixture(t, 3)
			s := f.openWith("n1", cfg)
			for i := range f.keys { // key 0 the oldest
				storeAndCheck(t, s.e, s.c, f.keys[i:i+1], f.blocks[i:i+1])
			}
			s.hit(t, f.keys[0], 1)
			s.close(t)

			s = f.openWith("n1", cfg)
			v, err := s.e.pol.Victims(ctx, abi.EvictRequest{Mount: abi.AnyMount, Bytes: 1 << 40, Time: uint64(f.clock().UnixNano())}, 3)
			if err != nil || len(v) != 3 {
				t.Fatalf("Victims = %v, %v; want all 3 files", v, err)
			}
			hot := s.e.find(s.e.tables.get(s.ns), f.keys[0]).ID
			if v[0].Entry == hot || v[2].Entry != hot {
				t.Fatalf("victims %v after the restart: the file hit before it (entry %d) should come last", v, hot)
			}
		})
	}
}

// A move's copy keeps its file's header id, and the move's INSERT the
// file's last access and hits (docs/abi.md): after a restart the copy
// restores with them, not with the time of the move (its mtime).
func TestAMovedFileRestoresWithItsLastAccessAndHits(t *testing.T) {
	ctx := context.Background()
	f := newAccessFixture(t, 12)
	// Hours before the wall clock: the hit comes before the copy's mtime.
	f.now = time.Now().Add(-3 * time.Hour)
	fileLen := 4096 + f.g.KeyBytes()
	cold := t.TempDir()
	cfg := Config{
		Mounts: []Mount{{Path: f.dir, Capacity: 6 * fileLen, HighWatermark: 0.9, LowWatermark: 0.6}, {Path: cold, DeviceClass: "network"}},
		NewPolicy: func(idx policy.Index) (policy.Policy, error) {
			return policy.NewNative(func() guest.Policy { return tiered.New() }, idx, policy.Config{Logger: testLogger(t)})
		},
		Now: f.clock, NodeID: "n1",
	}
	open := func() (*Engine, NamespaceID, *testCache) {
		e := openEngine(t, cfg)
		ns, err := e.Declare(ctx, f.g)
		if err != nil {
			t.Fatal(err)
		}
		c := newTestCache(t, e, ns, f.g, 64, layoutBlockFirst)
		r := rand.New(rand.NewPCG(1, 2))
		for _, b := range f.blocks {
			c.fill(r, b)
		}
		return e, ns, c
	}
	e, ns, c := open()
	storeAndCheck(t, e, c, f.keys[:1], f.blocks[:1])
	s := &accessSession{e: e, ns: ns, c: c}
	hit := s.hit(t, f.keys[0], 2)
	for i := 1; i < len(f.keys) && keyMount(e, ns, f.keys[0]) != 1; i++ {
		storeAndCheck(t, e, c, f.keys[i:i+1], f.blocks[i:i+1])
	}
	if m := keyMount(e, ns, f.keys[0]); m != 1 {
		t.Fatalf("the hit key is on mount %d after the stores, want the cold mount 1: the test proves nothing", m)
	}
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}

	e, ns, _ = open()
	en := e.find(e.tables.get(ns), f.keys[0])
	if en == nil || en.Mount != 1 {
		t.Fatalf("after the restart the hit key's entry is %+v, want one on the cold mount", en)
	}
	for _, pe := range e.ix.Files().PolicyEntries() {
		if pe.ID == en.ID && (int64(pe.LastAccess) != hit || pe.Hits != 2) {
			t.Fatalf("the moved file restores with last access %d, hits %d; want %d, 2", pe.LastAccess, pe.Hits, hit)
		}
	}
}

// A journal that cannot be written costs the restored figures of later
// uses, never a store, a lookup or a load: one warning names it, and the
// engine writes it no more.
func TestAJournalThatCannotBeWrittenWarnsOnceAndLosesNothingStored(t *testing.T) {
	ctx := context.Background()
	var buf lockedBuffer
	log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelWarn}))
	f := newAccessFixture(t, 2)
	inj := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		if op == fsys.OpWrite && isJournal(filepath.Base(path)) {
			return fsys.Fault{Err: syscall.EIO}
		}
		return fsys.Fault{}
	})
	s := f.openWith("n1", Config{Policy: newTestPolicy(1, abi.OrderLayerMajor), Logger: log, FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}})
	storeAndCheck(t, s.e, s.c, f.keys, f.blocks)
	warned := func() int {
		return len(buf.records(t, "engine: access journal failed: the files' uses on this mount are no longer kept across restarts"))
	}
	s.hit(t, f.keys[0], 1)
	testwait.Until(t, "the journal's warning", testwait.Hang, func() bool { return warned() > 0 })
	s.hit(t, f.keys[1], 1)
	want := s.c.data(f.blocks[1])
	into := [][]int{{40, 41, 42, 43}}
	loadAndCompare(t, s.e, s.c, f.keys[1:2], into, [][]byte{want})
	if err := s.e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if n := warned(); n != 1 {
		t.Fatalf("%d warnings of the journal that cannot be written, want 1", n)
	}
	if st := s.e.Stats(); st.Failures != 0 {
		t.Fatalf("%d failures beside the journal's", st.Failures)
	}
}
