//go:build invariants

package engine

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"sync/atomic"
	"testing"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
	"golang.org/x/sys/unix"
)

// checkedLoad loads keys into into and reports how many keys the load
// took as verified before (Stats.LoadKeysCheckedBefore's growth), after
// requiring every key loaded with want's bytes.
func checkedLoad(t *testing.T, e *Engine, c *testCache, keys [][]byte, into [][]int, lr LayerRange, want [][]byte) uint64 {
	t.Helper()
	before := e.Stats().LoadKeysCheckedBefore
	for _, b := range into {
		c.clear(b)
	}
	res := wait(t)(e.Load(context.Background(), LoadRequest{Cache: c.id, Keys: keys, Blocks: into, Layers: lr}))
	wantOutcomes(t, "load", res, OutcomeLoaded)
	if lr.all() {
		for i, b := range into {
			if !bytes.Equal(c.data(b), want[i]) {
				t.Fatalf("key %q loaded other bytes than were stored", keys[i])
			}
		}
	}
	return e.Stats().LoadKeysCheckedBefore - before
}

// storeSome stores n keys of fresh random blocks in e's cache c and
// returns the keys, the blocks and their bytes.
func storeSome(t *testing.T, e *Engine, c *testCache, n int) (keys [][]byte, blocks [][]int, want [][]byte) {
	t.Helper()
	r := rand.New(rand.NewPCG(3, 5))
	keys = testKeys("chk", n)
	for i := range n {
		b := []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}
		c.fill(r, b)
		blocks = append(blocks, b)
		want = append(want, c.data(b))
	}
	storeAndCheck(t, e, c, keys, blocks)
	return keys, blocks, want
}

// writtenSums is a host mover that says its write checksums are of the
// bytes written (transfer.WrittenSummer), as the GPU staging mover's are.
type writtenSums struct{ transfer.Mover }

func (writtenSums) SumsWritten() bool { return true }

func TestLoadsFromAMemoryMountSkipTheSumsOfWhatWasSummedUnlessEveryLoadIsChecked(t *testing.T) {
	for _, tc := range []struct {
		name        string
		sumsWritten bool // the store's sums are of the bytes it wrote
		everyLoad   bool
		want        [3]uint64 // keys taken as verified, per load
	}{
		{"a store summing the bytes it wrote", true, false, [3]uint64{4, 4, 4}},
		{"a store summing its source again, which the first load verifies", false, false, [3]uint64{0, 4, 4}},
		{"with checksum_every_load", true, true, [3]uint64{0, 0, 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := openEngine(t, Config{Mounts: []Mount{{Path: tmpfsDir(t), ChecksumEveryLoad: tc.everyLoad}}, Policy: newTestPolicy(2, 0)})
			if tc.sumsWritten {
				m := e.mounts[0]
				m.movers[region.KindHost] = writtenSums{m.movers[region.KindHost]}
			}
			_, c := declareSmall(t, e, 64)
			keys, _, want := storeSome(t, e, c, 4)
			into := [][]int{{40, 41, 42, 43}, {44, 45, 46, 47}, {48, 49, 50, 51}, {52, 53, 54, 55}}
			for load, w := range tc.want {
				if got := checkedLoad(t, e, c, keys, into, LayerRange{}, want); got != w {
					t.Errorf("load %d took %d keys as verified before, want %d", load, got, w)
				}
			}
		})
	}
}

// loadedOnce opens an engine on tmpfs, stores two keys through the host
// path and loads them once (which verifies them: the host path's store
// sums its source again); it returns the engine, the namespace, the
// cache, the keys, the blocks they loaded into and their bytes.
func loadedOnce(t *testing.T) (e *Engine, ns NamespaceID, c *testCache, keys [][]byte, into [][]int, want [][]byte) {
	t.Helper()
	e = openEngine(t, Config{Mounts: []Mount{{Path: tmpfsDir(t)}}, Policy: newTestPolicy(2, 0)})
	ns, c = declareSmall(t, e, 64)
	keys, _, want = storeSome(t, e, c, 2)
	into = [][]int{{40, 41, 42, 43}, {44, 45, 46, 47}}
	if got := checkedLoad(t, e, c, keys, into, LayerRange{}, want); got != 0 {
		t.Fatalf("the first load took %d keys as verified before, want 0 (the host path's store sums its source)", got)
	}
	return e, ns, c, keys, into, want
}

func TestAFileWrittenBehindTheEnginesBackIsVerifiedAgainAndFoundCorrupt(t *testing.T) {
	e, ns, c, keys, into, want := loadedOnce(t)
	if got := checkedLoad(t, e, c, keys, into, LayerRange{}, want); got != 2 {
		t.Fatalf("the load after a verified one took %d keys as verified, want 2", got)
	}
	en := e.find(e.tables.get(ns), keys[1])
	if en == nil {
		t.Fatal("the stored file is not indexed")
	}
	// One payload byte flipped by a writer that is not the engine.
	flipByte(t, en.Path, en.Size-100)
	before := e.Stats().LoadKeysCheckedBefore
	res := wait(t)(e.Load(context.Background(), LoadRequest{Cache: c.id, Keys: keys, Blocks: into}))
	corrupt := 0
	for i, k := range res.Keys {
		if k.Outcome == OutcomeFailed && errors.Is(k.Err, ErrCorrupt) {
			corrupt++
		} else if k.Outcome == OutcomeLoaded && !bytes.Equal(c.data(into[i]), want[i]) {
			t.Errorf("key %d reported loaded with other bytes than were stored", i)
		}
	}
	if corrupt == 0 {
		t.Errorf("no key of the file written behind the engine's back failed as corrupt: %+v", res.Keys)
	}
	if got := e.Stats().LoadKeysCheckedBefore - before; got != 0 {
		t.Errorf("the load took %d keys of the rewritten file as verified before, want 0", got)
	}
}

func TestAFileFoundAtOpenIsVerifiedOncePerLayerRange(t *testing.T) {
	dir := tmpfsDir(t)
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(2, 0)})
	_, c := declareSmall(t, e, 64)
	keys, _, want := storeSome(t, e, c, 2)
	e.Close(context.Background())

	// A new engine on the directory (a restart) trusts nothing it did not
	// verify itself: here not even its verification ahead of the loads,
	// since every file's ctime moved after it.
	e2 := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(2, 0)})
	if err := e2.verify.wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	touchFiles(t, e2)
	_, c2 := declareSmall(t, e2, 64)
	into := [][]int{{40, 41, 42, 43}, {44, 45, 46, 47}}
	for _, step := range []struct {
		lr   LayerRange
		want uint64
	}{
		{LayerRange{First: 0, Count: 2}, 0}, // verified now
		{LayerRange{First: 0, Count: 2}, 2}, // verified before
		{LayerRange{First: 1, Count: 2}, 0}, // layer 2 never verified
		{LayerRange{First: 3, Count: 1}, 0},
		{LayerRange{}, 2}, // every layer verified by now
	} {
		if got := checkedLoad(t, e2, c2, keys, into, step.lr, want); got != step.want {
			t.Errorf("load of layers %v took %d keys as verified before, want %d", step.lr, got, step.want)
		}
	}
}

// wait waits until the verifier tried every file, stopped, or ctx ended
// (Stats.FilesVerifiedAhead is final then); at once on a nil verifier.
func (v *verifier) wait(ctx context.Context) error {
	if v == nil {
		return nil
	}
	select {
	case <-v.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// touchFiles moves the ctime of every file e indexed (chmod: their
// bytes stay what they were).
func touchFiles(t *testing.T, e *Engine) {
	t.Helper()
	for _, p := range indexedPaths(e) {
		if err := os.Chmod(p, 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

// indexedPaths is the paths of the files e indexed.
func indexedPaths(e *Engine) []string {
	var paths []string
	e.ix.Files().Each(func(en *entry) { paths = append(paths, en.Path) })
	return paths
}

func TestFilesFoundAtOpenAreVerifiedAheadOfTheirLoads(t *testing.T) {
	dir := tmpfsDir(t)
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(2, 0)})
	ns, c := declareSmall(t, e, 64)
	keys, _, want := storeSome(t, e, c, 4)
	bad := e.find(e.tables.get(ns), keys[3])
	if bad == nil {
		t.Fatal("the stored file is not indexed")
	}
	badPath, badSize := bad.Path, bad.Size
	e.Close(context.Background())
	// One file's payload byte flipped while no engine ran.
	flipByte(t, badPath, badSize-100)

	e2 := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(2, 0)})
	if err := e2.verify.wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	files := len(indexedPaths(e2))
	if files < 2 {
		t.Fatalf("%d files indexed, want the keys in at least 2 (one of them corrupt)", files)
	}
	if got := e2.Stats().FilesVerifiedAhead; got != uint64(files-1) {
		t.Errorf("%d files verified ahead, want %d: every file found but the corrupt one", got, files-1)
	}
	ns2, c2 := declareSmall(t, e2, 64)
	// The keys of the other files: taken as verified at their first load.
	var good, goodWant [][]byte
	var into [][]int
	for i, k := range keys {
		if en := e2.find(e2.tables.get(ns2), k); en != nil && en.Path != badPath {
			good, goodWant = append(good, k), append(goodWant, want[i])
			into = append(into, []int{40 + 4*i, 41 + 4*i, 42 + 4*i, 43 + 4*i})
		}
	}
	if len(good) == 0 {
		t.Fatal("every key is in the corrupt file")
	}
	if got := checkedLoad(t, e2, c2, good, into, LayerRange{}, goodWant); got != uint64(len(good)) {
		t.Errorf("the restarted engine's first load took %d keys as verified before, want %d", got, len(good))
	}
	before := e2.Stats().LoadKeysCheckedBefore
	res := wait(t)(e2.Load(context.Background(), LoadRequest{Cache: c2.id, Keys: [][]byte{keys[3]}, Blocks: [][]int{{56, 57, 58, 59}}}))
	if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrCorrupt) {
		t.Errorf("the load of the corrupt file's key: %v %v, want it failed as corrupt", k.Outcome, k.Err)
	}
	if got := e2.Stats().LoadKeysCheckedBefore - before; got != 0 {
		t.Errorf("the load took %d keys of the corrupt file as verified before, want 0", got)
	}
}

func TestTheVerifierWaitsWhileFilesAreInFlightAndStopsWhileItWaits(t *testing.T) {
	var busy atomic.Bool
	v := &verifier{busy: busy.Load}
	v.ctx, v.stop = context.WithCancel(context.Background())
	if !v.quiet() {
		t.Fatal("quiet reported a stop with no file in flight and no stop")
	}
	busy.Store(true)
	got := make(chan bool)
	go func() { got <- v.quiet() }()
	v.stop()
	if <-got {
		t.Error("quiet reported quiet while a file was in flight")
	}
}

// touchingMover is a host mover that changes its file's ctime (chmod)
// after each read, as a writer behind the engine's back would meanwhile.
type touchingMover struct {
	transfer.Mover
}

func (m touchingMover) ReadFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	n, err := m.Mover.ReadFile(ctx, f, p, sums)
	if err == nil {
		err = unix.Fchmod(int(f.Fd()), 0o600)
	}
	return n, err
}

func TestALoadThatTookItsBytesAsVerifiedVerifiesThemWhereTheFileChangedWhileItRead(t *testing.T) {
	e, _, c, keys, into, want := loadedOnce(t)
	m := e.mounts[0]
	host := m.movers[region.KindHost]
	m.movers[region.KindHost] = touchingMover{host}
	// Its ctime moves while it is read: the round is read again and
	// verified (its bytes are unchanged), none taken as verified.
	if got := checkedLoad(t, e, c, keys, into, LayerRange{}, want); got != 0 {
		t.Errorf("the load whose file's ctime moved took %d keys as verified before, want 0", got)
	}
	m.movers[region.KindHost] = host
	// Nothing is known verified at the new ctime: the next load verifies,
	// the one after trusts.
	if got := checkedLoad(t, e, c, keys, into, LayerRange{}, want); got != 0 {
		t.Errorf("the load after the change took %d keys as verified before, want 0", got)
	}
	if got := checkedLoad(t, e, c, keys, into, LayerRange{}, want); got != 2 {
		t.Errorf("the load after it took %d keys as verified before, want 2", got)
	}
}
