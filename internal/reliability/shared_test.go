package reliability

import (
	"context"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/testsock"
)

// sharedVerify is the daemons' verify_interval in the shared-directory
// scenarios. sharedSlack is a margin beyond it for the file system, whose
// clients may show another client's change a moment late (a distributed
// file system's attribute caches): a lookup sent more than both after a
// key's file was seen removed or replaced must miss. It is no allowance
// for a slow machine: the checks bound when a lookup was sent, never how
// long anything took (staleHit).
const (
	sharedVerify = 200 * time.Millisecond
	sharedSlack  = 800 * time.Millisecond
)

// staleHit reports whether a lookup hit sent at sent, on a key whose file
// was seen removed or replaced at gone, is stale. The daemon checks a hit
// against the disk when the entry's last check is more than verify_interval
// older than the lookup; that check came before gone (a later one would have
// seen the change), and the daemon reads its clock after sent: so past
// the bound every hit is stale, however slowly the machine runs the
// daemons or the test.
func staleHit(sent, gone time.Time) bool { return sent.Sub(gone) > sharedVerify+sharedSlack }

// awaitMiss polls lookup until it misses and reports whether it did, or
// the age (since gone, when the key's file was seen removed or replaced)
// of the first stale hit (staleHit), which ends the wait. clusterWait
// bounds the wait, a hang guard for lookups that keep failing.
func awaitMiss(ctx context.Context, gone time.Time, lookup func() (int, error)) (missed bool, stale time.Duration) {
	waitFor(ctx, clusterWait, 10*time.Millisecond, func() bool {
		sent := time.Now()
		n, err := lookup()
		switch {
		case err != nil:
			return false
		case n == 0:
			missed = true
		case staleHit(sent, gone):
			stale = sent.Sub(gone)
		}
		return missed || stale > 0
	})
	return missed, stale
}

// startNodes starts one daemon per entry of mounts, "node-a", "node-b", …,
// each with its own socket and node identity, keys_per_file = 4, a short
// verify interval, and temp_grace set as docs/serve.md asks for shared
// mounts. mounts[i] is node i's path to the one shared directory: the
// same directory n times for daemons of one kernel, or one client mount
// each of a distributed file system (cluster_test.go).
func startNodes(t *testing.T, mounts []string) []*daemon {
	t.Helper()
	run := testsock.Dir(t)
	if nodeSetting("node-a") == "" {
		t.Log("the configuration has no node identity key (tried [engine] " + fmt.Sprint(nodeKeys) + "): the daemons run without one")
	}
	ds := make([]*daemon, len(mounts))
	for i, m := range mounts {
		node := "node-" + strings.ToLower(nodeName(i))
		ds[i] = startDaemon(t, daemonConfig{
			Socket:         filepath.Join(run, node, "kvhost.sock"),
			Mount:          m,
			KeysPerFile:    4,
			VerifyInterval: sharedVerify,
			TempGrace:      10 * time.Minute,
			Node:           node,
		})
	}
	return ds
}

// nodeName names node i in messages: "A", "B", ….
func nodeName(i int) string { return string(rune('A' + i)) }

// sharedCounts are the shared-directory scenarios' results.
type sharedCounts struct {
	ops, lookups, stores, deletes, loads atomic.Int64
	staleHits                            atomic.Int64 // lookup hits sent longer than the verify interval (+ slack) after the key was seen gone
	falsePresent                         atomic.Int64 // `present` answers whose next load on that daemon did not load the key
	lostStored                           atomic.Int64 // `stored` answers whose next load on that daemon did not load the key
	foreignDeleted                       atomic.Int64 // keys removed by a delete of a key in another file
	wrong                                atomic.Int64 // loads that returned other bytes
	unfound                              atomic.Int64 // keys on disk that a load on the other daemon reported missing (informational)
	inodeReused                          atomic.Int64 // rounds where the new file got the deleted file's inode
}

func (c *sharedCounts) String() string {
	return fmt.Sprintf("shared: ops=%d lookups=%d stores=%d deletes=%d loads=%d stale_hits=%d false_present=%d lost_stored=%d foreign_deleted=%d wrong_bytes=%d unfound=%d inode_reused=%d",
		c.ops.Load(), c.lookups.Load(), c.stores.Load(), c.deletes.Load(), c.loads.Load(), c.staleHits.Load(), c.falsePresent.Load(),
		c.lostStored.Load(), c.foreignDeleted.Load(), c.wrong.Load(), c.unfound.Load(), c.inodeReused.Load())
}

func (c *sharedCounts) bad() bool {
	return c.staleHits.Load()+c.falsePresent.Load()+c.lostStored.Load()+c.foreignDeleted.Load()+c.wrong.Load() > 0
}

// keyList turns strings into keys.
func keyList(ks ...string) [][]byte {
	out := make([][]byte, len(ks))
	for i, k := range ks {
		out[i] = []byte(k)
	}
	return out
}

// mustStore stores keys and fails the test unless every one is stored.
func mustStore(t *testing.T, k *kvCache, who string, keys [][]byte) {
	t.Helper()
	res, err := k.store(context.Background(), keys)
	if err != nil {
		t.Fatalf("%s: store %q: %v", who, keys, err)
	}
	if n := res.Count(client.OutcomeStored); n != len(keys) {
		t.Fatalf("%s: store %q: %d stored, outcomes %v (%s)", who, keys, n, res.Keys, res.Message)
	}
}

// TestSharedDirInodeReuse runs the inode-reuse scenario (inodeReuse) on
// two daemons sharing an ext4 directory, where a deleted file's inode
// number goes to the next new file at once.
func TestSharedDirInodeReuse(t *testing.T) {
	mnt, err := mountExt4(t, 128)
	if err != nil {
		t.Skipf("the inode-reuse case needs ext4, which hands a deleted file's inode number to the next file at once: %v", err)
	}
	inodeReuse(t, []string{mnt, mnt})
}

// inodeReuse runs the inode-reuse and stale-attribute cases on one daemon
// per mount (mounts[i] is node i's path to one shared directory) with
// keys_per_file = 4. In each subtest a node B stores [a,b,c,d]; the next
// node, A, finds a, deletes it and stores [a,x,y,z], which lands at the
// same path with the same size (and, on ext4, the same inode number).
// Then B's view of b must follow the disk:
//
//   - lookup: B's lookup of b becomes a miss within the verify interval;
//   - store: B's store of b that answers `present` or `stored` is followed
//     by a load on B that loads it;
//   - delete: B's delete of b removes none of A's keys;
//   - load: B, which loaded b (its client has the old file's attributes
//     and pages cached) before A replaced the file, loads b again at once:
//     b's bytes or a miss, never another key's bytes, and A's keys load on A.
//
// Subtest i uses B = node i mod n and A = node i+1 mod n, so that with
// three nodes every node plays both parts.
func inodeReuse(t *testing.T, mounts []string) {
	ds := startNodes(t, mounts)
	ctx := context.Background()
	ks := make([]*kvCache, len(ds))
	for i, d := range ds {
		c, k, err := dialCache(ctx, d.cfg.Socket, "node-"+nodeName(i), 16)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close(); k.close() })
		ks[i] = k
	}
	var counts sharedCounts
	defer func() { t.Log(counts.String()); fmt.Println(counts.String()) }()
	scan := func() map[string][]onDisk { return scanFiles(mounts[0]) }

	// setup runs the reproduction up to the point where B holds a stale
	// entry for b: keys p-a … p-z. It returns B's and A's caches.
	setup := func(t *testing.T, round int, p string, before func(kb *kvCache)) (kb, ka *kvCache, nb, na string) {
		t.Helper()
		ib, ia := round%len(ks), (round+1)%len(ks)
		kb, ka, nb, na = ks[ib], ks[ia], nodeName(ib), nodeName(ia)
		key := func(s string) string { return p + "-" + s }
		mustStore(t, kb, nb, keyList(key("a"), key("b"), key("c"), key("d")))
		counts.stores.Add(1)
		if before != nil {
			before(kb)
		}
		files := scan()[key("a")]
		if len(files) != 1 {
			t.Fatalf("%d files on disk hold %s after %s stored it", len(files), key("a"), nb)
		}
		old := files[0]
		if n, err := ka.c.Lookup(ctx, ka.ns.ID, keyList(key("a"))); err != nil || n != 1 {
			t.Fatalf("%s's lookup of %s (%s's file): %d, %v; want 1", na, key("a"), nb, n, err)
		}
		if n, err := ka.c.Delete(ctx, ka.ns.ID, keyList(key("a"))); err != nil || n != 1 {
			t.Fatalf("%s's delete of %s: %d, %v; want 1", na, key("a"), n, err)
		}
		counts.deletes.Add(1)
		mustStore(t, ka, na, keyList(key("a"), key("x"), key("y"), key("z")))
		counts.stores.Add(1)
		files = scan()[key("a")]
		if len(files) != 1 {
			t.Fatalf("%d files on disk hold %s after %s stored it", len(files), key("a"), na)
		}
		if now := files[0]; now.path == old.path && now.ino == old.ino {
			counts.inodeReused.Add(1)
			t.Logf("%s's file %s got %s's deleted file's inode %d", na, now.path, nb, now.ino)
		} else {
			t.Logf("inode not reused this time (%s ino %d, was %s ino %d): the round checks the plain replacement", now.path, now.ino, old.path, old.ino)
		}
		return kb, ka, nb, na
	}

	t.Run("lookup", func(t *testing.T) {
		kb, _, nb, na := setup(t, 0, "lk", nil)
		replaced := time.Now() // A's store has answered: the file is A's
		counts.lookups.Add(1)
		miss, stale := awaitMiss(ctx, replaced, func() (int, error) {
			return kb.c.Lookup(ctx, kb.ns.ID, keyList("lk-b"))
		})
		switch {
		case stale > 0:
			counts.staleHits.Add(1)
			t.Fatalf("%s's lookup of lk-b, sent %v after %s replaced the file, still hits (verify_interval %v, slack %v)", nb, stale.Round(time.Millisecond), na, sharedVerify, sharedSlack)
		case !miss:
			t.Fatalf("%s's lookup of lk-b neither missed nor answered within %v", nb, clusterWait)
		}
		t.Logf("%s's lookup of lk-b missed after %v", nb, time.Since(replaced).Round(time.Millisecond))
	})
	t.Run("store", func(t *testing.T) {
		kb, _, nb, _ := setup(t, 1, "st", nil)
		res, err := kb.store(ctx, keyList("st-b"))
		if err != nil {
			t.Fatal(err)
		}
		counts.stores.Add(1)
		o := res.Keys[0].Outcome
		if o != client.OutcomeStored && o != client.OutcomePresent {
			t.Fatalf("%s's store of st-b: %v (%s)", nb, o, res.Message)
		}
		r, err := kb.load(ctx, keyList("st-b"))
		if err != nil {
			t.Fatal(err)
		}
		counts.loads.Add(1)
		if !r.match[0] {
			if o == client.OutcomePresent {
				counts.falsePresent.Add(1)
			} else {
				counts.lostStored.Add(1)
			}
			t.Fatalf("%s's store of st-b answered %v, the next load on %s: %v (%s)", nb, o, nb, r.outcomes[0], r.message)
		}
	})
	t.Run("delete", func(t *testing.T) {
		kb, ka, nb, na := setup(t, 2, "dl", nil)
		before := scan()
		if _, err := kb.c.Delete(ctx, kb.ns.ID, keyList("dl-b")); err != nil {
			t.Fatal(err)
		}
		counts.deletes.Add(1)
		after := scan()
		var gone []string
		for _, k := range []string{"dl-a", "dl-x", "dl-y", "dl-z"} {
			if _, ok := after[k]; !ok {
				gone = append(gone, k)
			}
		}
		counts.foreignDeleted.Add(int64(len(gone)))
		if len(gone) > 0 {
			t.Fatalf("%s's delete of dl-b removed %s's keys %v (file %s, inode %d)", nb, na, gone, before["dl-a"][0].path, before["dl-a"][0].ino)
		}
		checkLoaded(t, ka, na, keyList("dl-a", "dl-x", "dl-y", "dl-z"), &counts)
	})
	t.Run("load", func(t *testing.T) {
		cached := func(kb *kvCache) {
			r, err := kb.load(ctx, keyList("ld-b", "ld-d"))
			if err != nil {
				t.Fatal(err)
			}
			counts.loads.Add(2)
			if !r.match[0] || !r.match[1] {
				t.Fatalf("load of ld-b, ld-d right after storing them: %v (%s)", r.outcomes, r.message)
			}
		}
		kb, ka, nb, na := setup(t, 3, "ld", cached)
		r, err := kb.load(ctx, keyList("ld-b", "ld-d"))
		if err != nil {
			t.Fatal(err)
		}
		counts.loads.Add(2)
		for i, o := range r.outcomes {
			switch {
			case r.match[i]:
				t.Logf("%s's load of key %d of its replaced file: loaded from the file it still has open", nb, i)
			case o == client.OutcomeLoaded:
				counts.wrong.Add(1)
				t.Errorf("%s's load of key %d right after %s replaced its file: other bytes", nb, i, na)
			default:
				t.Logf("%s's load of key %d right after %s replaced its file: %v", nb, i, na, o)
			}
		}
		checkLoaded(t, ka, na, keyList("ld-a", "ld-x", "ld-y", "ld-z"), &counts)
	})
	if counts.inodeReused.Load() == 0 {
		t.Log("no inode number was reused in any round: the rounds checked replacements by a new inode only")
	}
}

// checkLoaded loads keys on k (node who) and fails the test unless every
// one loads byte for byte, counting the loads and any wrong bytes.
func checkLoaded(t *testing.T, k *kvCache, who string, keys [][]byte, counts *sharedCounts) {
	t.Helper()
	r, err := k.load(context.Background(), keys)
	if err != nil {
		t.Fatal(err)
	}
	counts.loads.Add(int64(len(keys)))
	for i, ok := range r.match {
		if ok {
			continue
		}
		if r.outcomes[i] == client.OutcomeLoaded {
			counts.wrong.Add(1)
		} else {
			counts.lostStored.Add(1)
		}
		t.Errorf("%s's %s: %v (%s)", who, keys[i], r.outcomes[i], r.message)
	}
}

// sharedGroup is a set of keys that the mixed workload only touches under
// its lock, so that the test knows what is on disk for them.
type sharedGroup struct {
	mu      sync.Mutex
	keys    []string
	present map[string]bool      // on disk after the last operation
	changed map[string]time.Time // when the key's presence last changed
}

// refresh updates the group's view of the disk from a scan and notes
// which keys changed.
func (g *sharedGroup) refresh(disk map[string][]onDisk, now time.Time) {
	for _, k := range g.keys {
		on := len(disk[k]) > 0
		if on != g.present[k] {
			g.present[k] = on
			g.changed[k] = now
		}
	}
}

// TestSharedDirMixedWorkload runs the mixed workload (mixedWorkload) on
// two daemons sharing a directory: ext4 when it can mount one, else a
// temporary directory.
func TestSharedDirMixedWorkload(t *testing.T) {
	mnt, err := mountExt4(t, 256)
	if err != nil {
		t.Logf("running on a temporary directory instead of ext4: %v", err)
		mnt = t.TempDir()
	}
	duration := 8 * time.Second
	if long() {
		duration = 3 * time.Minute
	}
	mixedWorkload(t, []string{mnt, mnt}, duration)
}

// mixedWorkload runs random stores, loads, lookups and deletes of one key
// space for duration on one daemon per mount (mounts[i] is node i's path
// to one shared directory). Keys have equal lengths so that files of equal
// key counts have equal sizes. It checks every answer against what the
// files on disk hold (read through mounts[0]): no lookup hit on a key gone
// for longer than the verify interval, every `present` or `stored` answer
// followed by a successful load on that daemon, no delete removing a key
// of another file, no wrong byte.
func mixedWorkload(t *testing.T, mounts []string, duration time.Duration) {
	workers, groups := 4, 32
	rng := rand.New(rand.NewPCG(seed(t), 2))
	ds := startNodes(t, mounts)
	gs := make([]*sharedGroup, groups)
	for i := range gs {
		g := &sharedGroup{present: map[string]bool{}, changed: map[string]time.Time{}}
		for j := range 8 {
			g.keys = append(g.keys, fmt.Sprintf("g%02d-k%d", i, j))
		}
		gs[i] = g
	}
	var counts sharedCounts
	var mu sync.Mutex
	var examples []string
	report := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if len(examples) < 20 {
			examples = append(examples, fmt.Sprintf(format, args...))
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), duration)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wrng := rand.New(rand.NewPCG(rng.Uint64(), uint64(w)))
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- mixedWorker(ctx, w, wrng, ds, mounts[0], gs, &counts, report)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	t.Log(counts.String())
	fmt.Println(counts.String())
	if counts.bad() {
		t.Fatalf("%s\nexamples:\n%v", counts.String(), examples)
	}
	if counts.ops.Load() == 0 {
		t.Fatal("no operation ran")
	}
}

// mixer is one worker of the mixed workload: a connection to each daemon.
type mixer struct {
	ks     []*kvCache
	mnt    string
	counts *sharedCounts
	report func(string, ...any)
}

// store stores keys on daemon x, then loads them there: a key answered
// `stored` or `present` must load, byte for byte.
func (m *mixer) store(ctx context.Context, x int, keys [][]byte) error {
	k := m.ks[x]
	res, err := k.store(ctx, keys)
	if err != nil {
		return fmt.Errorf("%s store: %w", nodeName(x), err)
	}
	m.counts.stores.Add(1)
	r, err := k.load(ctx, keys)
	if err != nil {
		return fmt.Errorf("%s load: %w", nodeName(x), err)
	}
	m.counts.loads.Add(int64(len(keys)))
	for i, kr := range res.Keys {
		switch {
		case r.outcomes[i] == client.OutcomeLoaded && !r.match[i]:
			m.counts.wrong.Add(1)
			m.report("%s: %s loaded with other bytes", nodeName(x), keys[i])
		case r.match[i]:
		case kr.Outcome == client.OutcomePresent:
			m.counts.falsePresent.Add(1)
			m.report("%s: store of %s answered present, the next load: %v (%s)", nodeName(x), keys[i], r.outcomes[i], r.message)
		case kr.Outcome == client.OutcomeStored:
			m.counts.lostStored.Add(1)
			m.report("%s: store of %s answered stored, the next load: %v (%s)", nodeName(x), keys[i], r.outcomes[i], r.message)
		}
	}
	return nil
}

// delete deletes key on daemon x of group g's keys and checks that only
// files holding it went: a key that is in no such file must stay. It
// returns the disk after the delete.
func (m *mixer) delete(ctx context.Context, x int, g *sharedGroup, key []byte) (map[string][]onDisk, error) {
	k := m.ks[x]
	before := scanFiles(m.mnt)
	if _, err := k.c.Delete(ctx, k.ns.ID, [][]byte{key}); err != nil {
		return nil, fmt.Errorf("%s delete: %w", nodeName(x), err)
	}
	m.counts.deletes.Add(1)
	after := scanFiles(m.mnt)
	own := map[fileID]bool{}
	for _, f := range before[string(key)] {
		own[f.id()] = true
	}
	for _, other := range g.keys {
		if len(before[other]) == 0 || len(after[other]) > 0 {
			continue
		}
		for _, f := range before[other] {
			if !own[f.id()] {
				m.counts.foreignDeleted.Add(1)
				m.report("%s: delete of %s removed %s (file %s inode %d)", nodeName(x), key, other, f.path, f.ino)
				break
			}
		}
	}
	return after, nil
}

// lookup looks key up on daemon x: a hit on a key gone from disk, sent
// longer than the verify interval (and slack) after a scan saw it gone, is
// stale (staleHit).
func (m *mixer) lookup(ctx context.Context, x int, g *sharedGroup, key []byte) error {
	k := m.ks[x]
	sent := time.Now()
	n, err := k.c.Lookup(ctx, k.ns.ID, [][]byte{key})
	if err != nil {
		return fmt.Errorf("%s lookup: %w", nodeName(x), err)
	}
	m.counts.lookups.Add(1)
	if n == 1 && !g.present[string(key)] {
		if changed := g.changed[string(key)]; staleHit(sent, changed) {
			m.counts.staleHits.Add(1)
			m.report("%s: lookup of %s hits, gone from disk for %v", nodeName(x), key, sent.Sub(changed).Round(time.Millisecond))
		}
	}
	return nil
}

// load loads keys on daemon x: a loaded key must have its bytes; a key on
// disk that does not load is counted as unfound.
func (m *mixer) load(ctx context.Context, x int, g *sharedGroup, keys [][]byte) error {
	r, err := m.ks[x].load(ctx, keys)
	if err != nil {
		return fmt.Errorf("%s load: %w", nodeName(x), err)
	}
	m.counts.loads.Add(int64(len(keys)))
	for i := range keys {
		switch {
		case r.outcomes[i] == client.OutcomeLoaded && !r.match[i]:
			m.counts.wrong.Add(1)
			m.report("%s: %s loaded with other bytes", nodeName(x), keys[i])
		case r.outcomes[i] != client.OutcomeLoaded && g.present[string(keys[i])]:
			m.counts.unfound.Add(1)
		}
	}
	return nil
}

// replace is the inode-reuse pattern: daemon x finds key, deletes it and
// stores it again first in a file of four keys, which on ext4 often gets
// the deleted file's path, inode and size.
func (m *mixer) replace(ctx context.Context, x int, g *sharedGroup, keys [][]byte) error {
	k := m.ks[x]
	before := scanFiles(m.mnt)
	if _, err := k.c.Lookup(ctx, k.ns.ID, keys[:1]); err != nil {
		return fmt.Errorf("%s lookup: %w", nodeName(x), err)
	}
	m.counts.lookups.Add(1)
	mid, err := m.delete(ctx, x, g, keys[0])
	if err != nil {
		return err
	}
	g.refresh(mid, time.Now())
	if err := m.store(ctx, x, keys); err != nil {
		return err
	}
	after := scanFiles(m.mnt)
	for _, old := range before[string(keys[0])] {
		for _, f := range after[string(keys[0])] {
			if f.id() == old.id() && !slices.Equal(f.keys, old.keys) {
				m.counts.inodeReused.Add(1)
			}
		}
	}
	g.refresh(after, time.Now())
	return nil
}

// mixedWorker runs random operations on random groups until ctx ends. Each
// operation runs to completion under its group's lock (not cut by ctx), so
// that every answer is checked against the disk.
func mixedWorker(ctx context.Context, w int, rng *rand.Rand, ds []*daemon, mnt string, gs []*sharedGroup, counts *sharedCounts, report func(string, ...any)) error {
	m := &mixer{ks: make([]*kvCache, len(ds)), mnt: mnt, counts: counts, report: report}
	for i, d := range ds {
		c, k, err := dialCache(context.Background(), d.cfg.Socket, fmt.Sprintf("mixed-%d-%d", w, i), 16)
		if err != nil {
			return err
		}
		defer k.close()
		defer c.Close()
		m.ks[i] = k
	}
	octx := context.Background()
	for ctx.Err() == nil {
		g := gs[rng.IntN(len(gs))]
		x := rng.IntN(len(ds))
		pick := func(n int) [][]byte {
			var out [][]byte
			for _, i := range rng.Perm(len(g.keys))[:n] {
				out = append(out, []byte(g.keys[i]))
			}
			return out
		}
		g.mu.Lock()
		counts.ops.Add(1)
		var err error
		switch op := rng.IntN(20); {
		case op < 5:
			// Four keys most of the time: files of equal sizes.
			n := 4
			if op == 0 {
				n = 1 + rng.IntN(3)
			}
			if err = m.store(octx, x, pick(n)); err == nil {
				g.refresh(scanFiles(mnt), time.Now())
			}
		case op < 8:
			err = m.replace(octx, x, g, pick(4))
		case op < 10:
			var after map[string][]onDisk
			if after, err = m.delete(octx, x, g, pick(1)[0]); err == nil {
				g.refresh(after, time.Now())
			}
		case op < 16:
			err = m.lookup(octx, x, g, pick(1)[0])
		default:
			err = m.load(octx, x, g, pick(1+rng.IntN(4)))
		}
		g.mu.Unlock()
		if err != nil {
			return err
		}
	}
	return nil
}
