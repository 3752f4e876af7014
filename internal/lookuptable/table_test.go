package lookuptable

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
)

func newTable(t *testing.T, slots int, final bool) (*Table, *Reader) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kvhost.sock.lookup")
	tab, err := Create(path, slots, 0o640, -1, final)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tab.Close() })
	r, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return tab, r
}

func keysOf(prefix string, n int) [][]byte {
	keys := make([][]byte, n)
	for i := range keys {
		keys[i] = fmt.Appendf(nil, "%s-%06d", prefix, i)
	}
	return keys
}

func TestLeadingCountsKeysUpToTheFirstTheTableLacks(t *testing.T) {
	const fp = 0x1234
	tab, r := newTable(t, MinSlots, true)
	keys := keysOf("k", 8)
	for _, k := range keys[:5] {
		tab.Add(fp, string(k))
	}
	tab.Add(fp, string(keys[6])) // after the gap: not leading
	tests := []struct {
		name string
		fp   uint64
		keys [][]byte
		want int
	}{
		{"all held", fp, keys[:5], 5},
		{"a gap stops the count", fp, keys, 5},
		{"first missing", fp, keys[5:], 0},
		{"another namespace holds none", fp + 1, keys[:5], 0},
		{"no keys", fp, nil, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			n, final, ok := r.Leading(tc.fp, tc.keys)
			if !ok || !final || n != tc.want {
				t.Fatalf("Leading = %d, final %v, ok %v; want %d, final, ok", n, final, ok, tc.want)
			}
		})
	}
	tab.Remove(fp, string(keys[2]))
	if n, _, _ := r.Leading(fp, keys); n != 2 {
		t.Fatalf("after removing key 2: Leading = %d, want 2", n)
	}
	tab.Add(fp, string(keys[2]))
	if n, _, _ := r.Leading(fp, keys); n != 5 {
		t.Fatalf("after adding key 2 again: Leading = %d, want 5", n)
	}
}

func TestMissesAreFinalOnlyWhereTheDaemonSaysSo(t *testing.T) {
	_, r := newTable(t, MinSlots, false)
	if _, final, ok := r.Leading(1, keysOf("k", 1)); !ok || final {
		t.Fatalf("final %v ok %v on a table created without missesFinal", final, ok)
	}
}

func TestAFullTableDropsKeysAndItsMissesStopBeingFinalUntilItHoldsThemAgain(t *testing.T) {
	const fp = 7
	tab, r := newTable(t, MinSlots, true)
	limit := MinSlots / 4 * 3
	keys := keysOf("k", limit+10)
	for _, k := range keys {
		tab.Add(fp, string(k))
	}
	st := tab.Stats()
	if st.Keys != uint64(limit) || st.Dropped != 10 || st.Lacking != 10 {
		t.Fatalf("stats %+v: want %d keys, 10 dropped, 10 lacking", st, limit)
	}
	if n, final, ok := r.Leading(fp, keys); !ok || final || n != limit {
		t.Fatalf("full: Leading = %d final %v ok %v; want %d, not final", n, final, ok, limit)
	}
	// Each removal makes room for one key the table lacks.
	for _, k := range keys[:10] {
		tab.Remove(fp, string(k))
	}
	if st := tab.Stats(); st.Lacking != 0 || st.Keys != uint64(limit) {
		t.Fatalf("after 10 removals: %+v, want 0 lacking, %d keys", st, limit)
	}
	n, final, ok := r.Leading(fp, keys[10:])
	if !ok || !final || n != len(keys)-10 {
		t.Fatalf("after room was made: Leading = %d final %v ok %v; want %d, final", n, final, ok, len(keys)-10)
	}
}

func TestRemovedSlotsAreReclaimedBySweeps(t *testing.T) {
	const fp = 3
	tab, r := newTable(t, MinSlots, true)
	stable := keysOf("stable", 100)
	for _, k := range stable {
		tab.Add(fp, string(k))
	}
	// Ten table sizes of churn: without sweeps removed slots would
	// fill the table and new keys would be dropped.
	for i := range 10 * MinSlots {
		k := fmt.Sprintf("churn-%d", i)
		tab.Add(fp, k)
		tab.Remove(fp, k)
	}
	st := tab.Stats()
	if st.Sweeps == 0 || st.Dropped != 0 || st.Keys != 100 {
		t.Fatalf("stats %+v: want sweeps, nothing dropped, 100 keys", st)
	}
	if n, final, ok := r.Leading(fp, stable); !ok || !final || n != 100 {
		t.Fatalf("Leading = %d final %v ok %v; want 100", n, final, ok)
	}
}

// TestChurnAtTheLimitSweepsOnceASixteenthOfTheSlotsWereRemoved: at the
// three-quarters limit, whether the index holds more keys than that (each
// removal lets a key the table lacks in) or one fewer (a removal, then an
// add), a sweep of the slots starts once a sixteenth of them are removed
// (less those removed during the last sweep), not once per removal: a
// sweep goes over every slot.
func TestChurnAtTheLimitSweepsOnceASixteenthOfTheSlotsWereRemoved(t *testing.T) {
	const (
		fp       = 5
		slots    = MinSlots
		limit    = slots / 4 * 3
		removals = 2 * slots
	)
	tests := []struct {
		name string
		held int  // keys the index holds throughout the churn
		add  bool // whether each removal is followed by an add
	}{
		{"the table lacks keys the index holds", limit + removals, false},
		{"one key below the limit", limit - 1, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tab, r := newTable(t, slots, true)
			keys := keysOf("k", tc.held+removals+1)
			for _, k := range keys[:tc.held] {
				tab.Add(fp, string(k))
			}
			before := tab.Stats().Sweeps
			for i := range removals {
				tab.Remove(fp, string(keys[i]))
				if tc.add {
					tab.Add(fp, string(keys[tc.held+i]))
				}
			}
			if got, most := tab.Stats().Sweeps-before, uint64(removals/(slots/16-slots/sweepStep-1)+1); got > most {
				t.Errorf("%d removals swept the slots %d times, want at most %d", removals, got, most)
			}
			kept := min(tc.held, limit)
			n, final, ok := r.Leading(fp, keys[removals:removals+kept+1])
			if !ok || !final || n != kept {
				t.Fatalf("after the churn: Leading = %d final %v ok %v; want %d, final", n, final, ok, kept)
			}
		})
	}
}

// TestNoChangeGoesOverMoreThanABoundedNumberOfSlotsToReclaimRemovedOnes:
// the table's Add and Remove run under the engine's index lock, so
// reclaiming removed slots is spread over the changes that follow a
// sixteenth of the slots' worth of removals, each going over a bounded
// number of slots, not done for all the slots by one of them.
func TestNoChangeGoesOverMoreThanABoundedNumberOfSlotsToReclaimRemovedOnes(t *testing.T) {
	const (
		fp    = 13
		slots = 1 << 16
		held  = slots/4*3 - 1
		churn = 2 * slots
		most  = 2048
	)
	tab, r := newTable(t, slots, true)
	keys := keysOf("k", held+churn)
	for _, k := range keys[:held] {
		tab.Add(fp, string(k))
	}
	var worst uint64
	what := ""
	change := func(name string, i int, f func(fp uint64, key string)) {
		before := tab.Stats().Swept
		f(fp, string(keys[i]))
		if got := tab.Stats().Swept - before; got > worst {
			worst, what = got, name
		}
	}
	for i := range churn {
		change("removal", i, tab.Remove)
		change("add", held+i, tab.Add)
	}
	if worst > most {
		t.Errorf("one %s went over %d of the %d slots reclaiming removed ones; want at most %d", what, worst, slots, most)
	}
	st := tab.Stats()
	if st.Sweeps == 0 || st.Dropped != 0 {
		t.Fatalf("stats %+v: want removed slots reclaimed, nothing dropped", st)
	}
	n, final, ok := r.Leading(fp, keys[churn:])
	if !ok || !final || n != held {
		t.Fatalf("after the churn: Leading = %d final %v ok %v; want %d, final", n, final, ok, held)
	}
}

// TestReadersNeverMissAHeldKeyWhileTheWriterChurns: a reader racing with
// adds, removes and sweeps either finds every key held throughout or
// is told to ask the daemon; it never reports a held key missing.
func TestReadersNeverMissAHeldKeyWhileTheWriterChurns(t *testing.T) {
	const fp = 11
	tab, r := newTable(t, MinSlots, true)
	stable := keysOf("stable", 64)
	for _, k := range stable {
		tab.Add(fp, string(k))
	}
	var done atomic.Bool
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer done.Store(true)
		for i := range 20 * MinSlots {
			k := fmt.Sprintf("churn-%d", i)
			tab.Add(fp, k)
			if i%2 == 0 {
				tab.Remove(fp, k)
			}
			if i%64 == 63 {
				for j := i - 63; j <= i; j += 2 {
					tab.Remove(fp, fmt.Sprintf("churn-%d", j))
				}
			}
		}
	}()
	answered, retried := 0, 0
	for !done.Load() {
		n, _, ok := r.Leading(fp, stable)
		if !ok {
			retried++
			continue
		}
		answered++
		if n != len(stable) {
			t.Fatalf("a reader saw %d of %d held keys during churn", n, len(stable))
		}
	}
	wg.Wait()
	if tab.Stats().Sweeps == 0 {
		t.Fatal("the churn made no sweep: the test did not race a reader with one")
	}
	t.Logf("%d answers, %d retries, %d sweeps", answered, retried, tab.Stats().Sweeps)
}

func TestOpenRefusesFilesThatAreNotTables(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good")
	tab, err := Create(good, MinSlots, 0o600, -1, true)
	if err != nil {
		t.Fatal(err)
	}
	defer tab.Close()
	img, err := os.ReadFile(good)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name  string
		bytes func([]byte) []byte
	}{
		{"short", func(b []byte) []byte { return b[:100] }},
		{"bad magic", func(b []byte) []byte { b[0] = 'X'; return b }},
		{"other version", func(b []byte) []byte { binary.LittleEndian.PutUint32(b[offVersion:], 9); return b }},
		{"size disagrees with the slot count", func(b []byte) []byte { return append(b, make([]byte, 8)...) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, "bad")
			if err := os.WriteFile(p, tc.bytes(append([]byte(nil), img...)), 0o600); err != nil {
				t.Fatal(err)
			}
			if r, err := Open(p); !errors.Is(err, ErrFormat) {
				if r != nil {
					r.Close()
				}
				t.Fatalf("Open = %v, want ErrFormat", err)
			}
		})
	}
}

func TestCloseTellsReadersAndLeavesANewerTableInPlace(t *testing.T) {
	path := filepath.Join(t.TempDir(), "t")
	old, err := Create(path, MinSlots, 0o600, -1, true)
	if err != nil {
		t.Fatal(err)
	}
	r, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	newer, err := Create(path, MinSlots, 0o600, -1, true)
	if err != nil {
		t.Fatal(err)
	}
	defer newer.Close()
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	if _, _, ok := r.Leading(1, keysOf("k", 1)); ok {
		t.Fatal("a reader of a closed table was answered")
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("closing the old table removed the newer one: %v", err)
	}
	old.Add(1, "after close") // no effect, no fault
}

// TestCreateDoesNotFollowALinkPlantedWhereItMakesTheFile: in a directory
// others can write, a link planted at the name of the file Create makes
// (then renames into place) would have it truncate and map the file the
// link names.
func TestCreateDoesNotFollowALinkPlantedWhereItMakesTheFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "kvhost.sock.lookup")
	victim := filepath.Join(dir, "victim")
	if err := os.WriteFile(victim, []byte("not a table"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(victim, fmt.Sprintf("%s.%d.tmp", path, os.Getpid())); err != nil {
		t.Fatal(err)
	}
	tab, err := Create(path, MinSlots, 0o600, -1, true)
	if err == nil {
		defer tab.Close()
	}
	if b, err := os.ReadFile(victim); err != nil || string(b) != "not a table" {
		t.Fatalf("the link's target now reads %.20q (%v), want it untouched", b, err)
	}
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSymlink != 0 {
		t.Fatalf("the table's path is the planted link")
	}
}

func TestCreateRoundsTheSlotCountUp(t *testing.T) {
	for _, n := range []int{0, 1, MinSlots, MinSlots + 1, 5000} {
		tab, err := Create(filepath.Join(t.TempDir(), "t"), n, 0o600, -1, true)
		if err != nil {
			t.Fatal(err)
		}
		if got := tab.Slots(); got != slotsFor(n) || got < n {
			t.Errorf("Create(%d) made %d slots, want %d", n, got, slotsFor(n))
		}
		tab.Close()
	}
}

// TestHashIsTheFormatsKnownAnswer pins the tag and home of one key: the
// Python client's test checks its own hash against the same pair.
func TestHashIsTheFormatsKnownAnswer(t *testing.T) {
	tag, home := Hash(0x0102030405060708, []byte("key-1"))
	if tag != 4970651553208285916 || home != 364090413704195124 {
		t.Fatalf("Hash = (%d, %d), want (4970651553208285916, 364090413704195124)", tag, home)
	}
}

// TestHashOfLongKeysMatchesTheStreamedDigest: keys longer than the stack
// buffer hash as the digest of fingerprint then key, like short ones.
func TestHashOfLongKeysMatchesTheStreamedDigest(t *testing.T) {
	for _, n := range []int{255, 256, 257, 1000} {
		key := make([]byte, n)
		for i := range key {
			key[i] = byte(i)
		}
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], 42)
		sum := sha256.Sum256(append(b[:], key...))
		tag, home := Hash(42, key)
		wantTag := binary.LittleEndian.Uint64(sum[:8])
		if wantTag <= 1 {
			wantTag += 2
		}
		if tag != wantTag || home != binary.LittleEndian.Uint64(sum[8:16]) {
			t.Fatalf("%d-byte key: Hash = (%d, %d), want the digest's (%d, %d)", n, tag, home, wantTag, binary.LittleEndian.Uint64(sum[8:16]))
		}
	}
}

func BenchmarkHash(b *testing.B) {
	key := []byte("0123456789abcdef0123456789abcdef")
	b.ReportAllocs()
	for b.Loop() {
		Hash(7, key)
	}
}
