//go:build invariants

package engine

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/internal/fstype"
	"github.com/kvhost/kvhost/internal/testlog"
)

// logCount is a slog handler that counts records whose message contains
// a string, and passes them to the test log.
type logCount struct {
	slog.Handler
	match string
	n     *atomic.Int64
}

func (l logCount) Handle(ctx context.Context, r slog.Record) error {
	if strings.Contains(r.Message, l.match) {
		l.n.Add(1)
	}
	return l.Handler.Handle(ctx, r)
}

func (l logCount) WithAttrs(a []slog.Attr) slog.Handler {
	return logCount{l.Handler.WithAttrs(a), l.match, l.n}
}

func countingLogger(t *testing.T, match string) (*slog.Logger, *atomic.Int64) {
	n := &atomic.Int64{}
	h := slog.NewTextHandler(testlog.Writer(t), &slog.HandlerOptions{Level: slog.LevelInfo})
	return slog.New(logCount{h, match, n}), n
}

// TestStartOnFullFileSystem: with every create of a temporary or probe
// file and every write failing with ENOSPC (a file system 100% full),
// Open succeeds with buffered I/O (the probe's failure is logged, not
// fatal), lookups and loads serve what is stored, and a store fails with
// ErrNoSpace, counted by reason and logged.
func TestStartOnFullFileSystem(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0)})
	_, c := declareSmall(t, e, 32)
	r := rand.New(rand.NewPCG(1, 2))
	keys := testKeys("full", 2)
	blocks := blockLists(r, 2, 4, 0)
	for _, b := range blocks {
		c.fill(r, b)
	}
	want := [][]byte{c.data(blocks[0]), c.data(blocks[1])}
	storeAndCheck(t, e, c, keys, blocks)
	e.Close(ctx)

	full := fsys.InjectorFunc(func(op fsys.Op, path string) fsys.Fault {
		base := filepath.Base(path)
		switch {
		case op == fsys.OpOpen && (strings.HasPrefix(base, tmpPrefix) || strings.HasPrefix(base, probePrefix)),
			op == fsys.OpWrite, op == fsys.OpAllocate:
			return fsys.Fault{Err: syscall.ENOSPC}
		}
		return fsys.Fault{}
	})
	log, failLines := countingLogger(t, "store failed")
	e2 := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), FS: &fsys.Faulty{FS: fsys.OS{}, Inj: full}, Logger: log})
	if m := e2.Stats().Mounts[0]; m.IO != IOBuffered {
		t.Fatalf("mount after a failed probe: %+v, want buffered", m)
	}
	ns2, c2 := declareSmall(t, e2, 32)
	if n, _ := e2.Lookup(ctx, ns2, keys); n != 2 {
		t.Fatalf("lookup: %d", n)
	}
	loadAndCompare(t, e2, c2, keys, [][]int{{8, 9, 10, 11}, {12, 13, 14, 15}}, want)
	// The failure log's interval is 10 s; an hour here puts the two
	// failures below within one, however slowly the machine runs them.
	e2.st.fails.interval = time.Hour
	for range 2 {
		res := wait(t)(e2.Store(ctx, StoreRequest{Cache: c2.id, Keys: testKeys("new", 1), Blocks: [][]int{{16, 17, 18, 19}}}))
		if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrNoSpace) {
			t.Fatalf("store on a full file system: %v %v", k.Outcome, k.Err)
		}
	}
	if f := e2.Stats().StoreFailures; f.NoSpace != 2 || f.IO != 0 || f.Other != 0 {
		t.Fatalf("store failures %+v, want 2 no-space", f)
	}
	if n := failLines.Load(); n != 1 {
		t.Fatalf("%d log lines for 2 failures within the interval, want 1", n)
	}
}

// smallDisk is the OS file system whose statfs reports a disk of total
// bytes holding foreign bytes besides the files under root.
type smallDisk struct {
	fsys.OS
	root           string
	total, foreign int64
	typ            int64 // the file system's magic: ext4 where 0
}

func (d *smallDisk) Statfs(path string) (fsys.StatFS, error) {
	var used int64
	filepath.Walk(d.root, func(_ string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			used += fi.Size()
		}
		return nil
	})
	free := max(0, d.total-d.foreign-used)
	typ := d.typ
	if typ == 0 {
		typ = fstype.Ext4
	}
	return fsys.StatFS{Type: typ, BlockSize: 4096, Total: d.total, Free: free, Avail: free}, nil
}

// TestDerivedCapacityLargerThanTheFileSystemIsNotReported: a capacity
// nobody configured (kvhost's 90% of the file system's size, computed
// before the engine counts what others use there) is cut to what the file
// system holds without the warning meant for a configured one.
func TestDerivedCapacityLargerThanTheFileSystemIsNotReported(t *testing.T) {
	for _, tc := range []struct {
		name    string
		derived bool
		warned  int64
	}{
		{"configured", false, 1},
		{"derived", true, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			disk := &smallDisk{root: dir, total: 4 << 20, foreign: 2 << 20}
			log, warned := countingLogger(t, "configured capacity is more than")
			e := openEngine(t, Config{Mounts: []Mount{{Path: dir, Capacity: 9 * (4 << 20) / 10, CapacityDerived: tc.derived}}, Policy: newTestPolicy(1, 0), FS: disk, Logger: log})
			if m := e.Stats().Mounts[0]; m.Capacity != 2<<20 {
				t.Fatalf("mount %+v, want capacity 2 MiB (what the file system holds)", m)
			}
			if n := warned.Load(); n != tc.warned {
				t.Fatalf("%d warnings, want %d", n, tc.warned)
			}
		})
	}
}

// TestCapacityKnowsFileSystem: with a configured capacity of 1 GiB on a
// 4 MiB file system holding 1 MiB of foreign data and a 512 KiB reserve,
// the effective capacity is 2.5 MiB, the mismatch is logged once, and
// stores evict to stay within it: none fails.
func TestCapacityKnowsFileSystem(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	disk := &smallDisk{root: dir, total: 4 << 20, foreign: 1 << 20}
	log, warned := countingLogger(t, "configured capacity is more than")
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir, Capacity: 1 << 30, Reserve: 512 << 10}}, Policy: newTestPolicy(1, 0), FS: disk, Logger: log})
	if m := e.Stats().Mounts[0]; m.Capacity != 5<<19 || m.Configured != 1<<30 || m.Reserve != 512<<10 {
		t.Fatalf("mount %+v, want capacity 2.5 MiB", m)
	}
	_, c := declareSmall(t, e, 64) // 128 KiB + 4 KiB per file
	for i := range 40 {
		res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: testKeys(fmt.Sprint("cap", i), 1), Blocks: [][]int{{0, 1, 2, 3}}}))
		if k := res.Keys[0]; k.Outcome != OutcomeStored {
			t.Fatalf("store %d: %v %v", i, k.Outcome, k.Err)
		}
	}
	st := e.Stats()
	if m := st.Mounts[0]; m.Used > 5<<19 || st.Evictions == 0 {
		t.Fatalf("after 40 stores: %+v", st)
	}
	if n := warned.Load(); n != 1 {
		t.Fatalf("capacity mismatch logged %d times, want once", n)
	}
}

// enospcOnce fails the first armed allocation with ENOSPC (or every one
// with sticky).
type enospcOnce struct {
	armed, sticky atomic.Bool
	fired         atomic.Int64
}

func (f *enospcOnce) Inject(op fsys.Op, _ string) fsys.Fault {
	if op == fsys.OpAllocate && f.armed.Load() && (f.sticky.Load() || f.fired.Load() == 0) {
		f.fired.Add(1)
		return fsys.Fault{Err: syscall.ENOSPC}
	}
	return fsys.Fault{}
}

// TestENOSPCRetried: an ENOSPC from the file system makes the store refresh
// the capacity, evict and try again: a single one is absorbed (the key is
// stored); a lasting one fails the key with ErrNoSpace, counted.
func TestENOSPCRetried(t *testing.T) {
	ctx := context.Background()
	inj := &enospcOnce{}
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, 0), FS: &fsys.Faulty{FS: fsys.OS{}, Inj: inj}})
	_, c := declareSmall(t, e, 32)
	inj.armed.Store(true)
	storeAndCheck(t, e, c, testKeys("once", 1), [][]int{{0, 1, 2, 3}})
	if inj.fired.Load() != 1 {
		t.Fatalf("ENOSPC injected %d times", inj.fired.Load())
	}
	inj.sticky.Store(true)
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: testKeys("always", 1), Blocks: [][]int{{4, 5, 6, 7}}}))
	if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrNoSpace) || !errors.Is(k.Err, syscall.ENOSPC) {
		t.Fatalf("lasting ENOSPC: %v %v", k.Outcome, k.Err)
	}
	if n := inj.fired.Load(); n != 3 {
		t.Fatalf("ENOSPC injected %d times, want 3 (one, then two attempts)", n)
	}
	if f := e.Stats().StoreFailures; f.NoSpace != 1 {
		t.Fatalf("failures %+v", f)
	}
}

// fullerDisk is a smallDisk whose allocations fail with ENOSPC, as the
// file system's would, where fewer than need bytes are free.
type fullerDisk struct {
	disk *smallDisk
	need int64
}

func (f *fullerDisk) Inject(op fsys.Op, _ string) fsys.Fault {
	if op != fsys.OpAllocate {
		return fsys.Fault{}
	}
	if st, _ := f.disk.Statfs(f.disk.root); st.Avail < f.need {
		return fsys.Fault{Err: syscall.ENOSPC}
	}
	return fsys.Fault{}
}

// TestENOSPCFromAFileSystemFilledByOthersEvictsForTheRetry: another
// program fills the file system behind the engine's back; the next store's
// allocation fails with ENOSPC, and its retry, having refreshed the
// capacity without counting its own reservation (which holds nothing on
// the file system once its file is removed), evicts an older file and
// stores the key. On a memory file system, counting the reservation as
// the engine's bytes there made the refreshed capacity one file larger
// than the file system's room: the eviction kept its victim as a spare
// (its pages still taken), and the retry's fresh file failed with ENOSPC
// again.
func TestENOSPCFromAFileSystemFilledByOthersEvictsForTheRetry(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	disk := &smallDisk{root: dir, total: 4 << 20, typ: fstype.Tmpfs}
	fileLen := 4096 + smallGeometry(true).KeyBytes()
	full := &fullerDisk{disk: disk, need: fileLen}
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0), FS: &fsys.Faulty{FS: disk, Inj: full}})
	_, c := declareSmall(t, e, 64)
	storeAndCheck(t, e, c, testKeys("before", 2), [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}})
	st, _ := disk.Statfs(dir)
	disk.foreign = st.Avail // another program takes every free byte
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: testKeys("after", 1), Blocks: [][]int{{8, 9, 10, 11}}}))
	if k := res.Keys[0]; k.Outcome != OutcomeStored {
		t.Fatalf("store on a file system others filled: %v %v; want it stored after an eviction", k.Outcome, k.Err)
	}
	if s := e.Stats(); s.Evictions == 0 || s.Failures != 0 {
		t.Fatalf("%d evictions, %d failed keys; want the retry to have evicted, and none failed", s.Evictions, s.Failures)
	}
}

// TestLoadRepeatedKey: a key named twice in one load with different
// destination blocks is loaded into both, and nothing is counted failed.
func TestLoadRepeatedKey(t *testing.T) {
	for _, kpf := range []uint32{1, 4} {
		t.Run(fmt.Sprint("keys_per_file=", kpf), func(t *testing.T) {
			e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(kpf, 0)})
			_, c := declareSmall(t, e, 64)
			r := rand.New(rand.NewPCG(4, 4))
			keys := testKeys("dup", 2)
			blocks := blockLists(r, 2, 4, 0)
			for _, b := range blocks {
				c.fill(r, b)
			}
			storeAndCheck(t, e, c, keys, blocks)
			k0, k1 := c.data(blocks[0]), c.data(blocks[1])
			req := [][]byte{keys[0], keys[1], keys[0], keys[0]}
			into := [][]int{{20, 21, 22, 23}, {24, 25, 26, 27}, {28, 29, 30, 31}, {32, 33, 34, 35}}
			loadAndCompare(t, e, c, req, into, [][]byte{k0, k1, k0, k0})
			if st := e.Stats(); st.Failures != 0 {
				t.Fatalf("failures %d", st.Failures)
			}
		})
	}
}

// TestTruncatedFileIsCorrupt: a file truncated under a running engine
// fails its load with ErrCorrupt (not an internal error), and is removed.
func TestTruncatedFileIsCorrupt(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0)})
	_, c := declareSmall(t, e, 32)
	storeAndCheck(t, e, c, testKeys("trunc", 1), [][]int{{0, 1, 2, 3}})
	files := dataFiles(t, dir)
	if err := os.Truncate(files[0], 4096+8192); err != nil {
		t.Fatal(err)
	}
	res := wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: testKeys("trunc", 1), Blocks: [][]int{{8, 9, 10, 11}}}))
	if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrCorrupt) {
		t.Fatalf("load of a truncated file: %v %v", k.Outcome, k.Err)
	}
	if _, err := os.Stat(files[0]); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("truncated file kept: %v", err)
	}
	if f := e.Stats().LoadFailures; f.Corrupt != 1 {
		t.Fatalf("load failures %+v", f)
	}
}

// TestCorruptFilesRemovedAtStart: Open removes kvhost files that fail
// their header checks or are shorter than their header says (counted in
// Stats.Corrupt), and leaves files that are not kvhost files alone.
func TestCorruptFilesRemovedAtStart(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0)})
	ns, c := declareSmall(t, e, 32)
	keys := testKeys("cor", 3)
	storeAndCheck(t, e, c, keys, [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}})
	e.Close(ctx)
	_, paths, _, _ := e.nm.names(ctx, e.tables.get(ns), keys)
	f, _ := os.OpenFile(paths[0], os.O_RDWR, 0)
	f.WriteAt([]byte{0x55}, 40) // header checksum fails
	f.Close()
	os.Truncate(paths[1], 8192) // shorter than the header says
	other := filepath.Join(dir, "notes.txt")
	os.WriteFile(other, []byte("not a kvhost file"), 0o644)

	e2 := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0)})
	st := e2.Stats()
	if st.Corrupt != 2 || st.Entries != 1 || st.Mounts[0].Used != int64(4096+128<<10) {
		t.Fatalf("stats after Open: %+v", st)
	}
	for _, p := range paths[:2] {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("corrupt file %s kept: %v", p, err)
		}
	}
	if _, err := os.Stat(other); err != nil {
		t.Fatalf("a file that is not ours was removed: %v", err)
	}
}

// TestAFileWhoseKeysRepeatIsRemovedAtStart: the keys of one file are
// distinct (docs/format.md); a file whose header repeats a key, under a
// good checksum, is corrupt as other header faults are: Open counts it in
// Stats.Corrupt and removes it, and the key it repeats, stored in another
// file, still loads as it was stored.
func TestAFileWhoseKeysRepeatIsRemovedAtStart(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(2, 0)})
	_, c := declareSmall(t, e, 32)
	keys := testKeys("rep", 4)
	blocks := [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}
	c.fill(rand.New(rand.NewPCG(7, 7)), slices.Concat(blocks...))
	storeAndCheck(t, e, c, keys[:2], blocks[:2])
	storeAndCheck(t, e, c, keys[2:], blocks[2:])
	want := [][]byte{c.data(blocks[2]), c.data(blocks[3])}
	e.Close(ctx)

	// The file of keys 0 and 1, and key 2's entry in the other file.
	var (
		victim string
		entry  []byte
	)
	for _, p := range dataFiles(t, dir) {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		h, err := format.Decode(b)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		switch {
		case len(h.Keys) == 2 && bytes.Equal(h.Keys[0].Key, keys[0]):
			victim = p
		case len(h.Keys) == 2 && bytes.Equal(h.Keys[0].Key, keys[2]):
			entry = bytes.Clone(b[format.FixedLen:][:format.KeyEntryLen])
		}
	}
	if victim == "" || entry == nil {
		t.Fatalf("files %v: want one of keys %q and %q and one of %q and %q", dataFiles(t, dir), keys[0], keys[1], keys[2], keys[3])
	}
	// The victim now says it holds key 2 twice, under a good checksum.
	hdr := make([]byte, format.Align)
	f, err := os.OpenFile(victim, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.ReadAt(hdr, 0); err != nil {
		t.Fatal(err)
	}
	copy(hdr[format.FixedLen:], entry)
	copy(hdr[format.FixedLen+format.KeyEntryLen:], entry)
	used := format.FixedLen + 2*format.KeyEntryLen
	binary.LittleEndian.PutUint32(hdr[20:], 0)
	binary.LittleEndian.PutUint32(hdr[20:], crc32c.Checksum(hdr[:used]))
	if _, err := f.WriteAt(hdr, 0); err != nil {
		t.Fatal(err)
	}

	e2 := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(2, 0)})
	if st := e2.Stats(); st.Corrupt != 1 || st.Entries != 1 {
		t.Fatalf("after Open: %d corrupt, %d entries: want 1 corrupt (the file whose keys repeat) and 1 entry", st.Corrupt, st.Entries)
	}
	if _, err := os.Stat(victim); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the file whose keys repeat is kept: %v", err)
	}
	_, c2 := declareSmall(t, e2, 32)
	loadAndCompare(t, e2, c2, keys[2:], [][]int{{16, 17, 18, 19}, {20, 21, 22, 23}}, want)
}

// TestDirectoryAtKeyPath: a directory where a key's file should be fails
// the key's store with ErrPolicy naming the path (not an internal error),
// the key's load and lookup miss, and other keys are unaffected.
func TestDirectoryAtKeyPath(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	e := openEngine(t, Config{Mounts: []Mount{{Path: dir}}, Policy: newTestPolicy(1, 0)})
	ns, c := declareSmall(t, e, 32)
	keys := testKeys("dir", 2)
	_, paths, _, _ := e.nm.names(ctx, e.tables.get(ns), keys[:1])
	if err := os.MkdirAll(filepath.Join(paths[0], "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	res := wait(t)(e.Store(ctx, StoreRequest{Cache: c.id, Keys: keys, Blocks: [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}}))
	if k := res.Keys[0]; k.Outcome != OutcomeFailed || !errors.Is(k.Err, ErrPolicy) || !strings.Contains(k.Err.Error(), "is a directory") {
		t.Fatalf("store where a directory is: %v %v", k.Outcome, k.Err)
	}
	if k := res.Keys[1]; k.Outcome != OutcomeStored {
		t.Fatalf("other key: %v %v", k.Outcome, k.Err)
	}
	res = wait(t)(e.Load(ctx, LoadRequest{Cache: c.id, Keys: keys[:1], Blocks: [][]int{{8, 9, 10, 11}}}))
	if k := res.Keys[0]; k.Outcome != OutcomeMissing {
		t.Fatalf("load where a directory is: %v %v", k.Outcome, k.Err)
	}
	if n, _ := e.Lookup(ctx, ns, keys[:1]); n != 0 {
		t.Fatalf("lookup where a directory is: %d", n)
	}
	if l := leftovers(t, dir); len(l) != 0 {
		t.Fatalf("leftovers %v", l)
	}
}

// TestRegisterCacheOverflow: strides, offsets and block counts whose
// products overflow or leave the region are refused by the engine itself
// with ErrInvalid, never accepted to panic a worker later.
func TestRegisterCacheOverflow(t *testing.T) {
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, 0)})
	ns, c := declareSmall(t, e, 8)
	for _, tc := range []struct {
		name string
		mod  func(*LayerTensor)
	}{
		{"block stride 1<<62", func(l *LayerTensor) { l.NumBlocks, l.BlockStride = 5, 1<<62 }},
		{"block stride max", func(l *LayerTensor) { l.NumBlocks, l.BlockStride = 3, 1<<63-1 }},
		{"plane stride 1<<62", func(l *LayerTensor) { l.PlaneStride = 1 << 62 }},
		{"num blocks huge", func(l *LayerTensor) { l.NumBlocks = 1 << 40 }},
		{"offset past the region", func(l *LayerTensor) { l.Offset = 1 << 62 }},
		{"offset max", func(l *LayerTensor) { l.Offset = 1<<63 - 1 }},
		{"stride times blocks wraps", func(l *LayerTensor) { l.NumBlocks, l.BlockStride = 1<<33+1, 1<<31 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			layers := append([]LayerTensor(nil), c.layers...)
			tc.mod(&layers[2])
			if _, err := e.RegisterCache(ns, layers); !errors.Is(err, ErrInvalid) {
				t.Fatalf("RegisterCache: %v, want ErrInvalid", err)
			}
		})
	}
}

// TestRebuildSeveralMounts: the parallel rebuild of several mounts with
// leftovers to clean counts them without a data race (run with -race) and
// indexes every file.
func TestRebuildSeveralMounts(t *testing.T) {
	ctx := context.Background()
	var mounts []Mount
	for range 4 {
		mounts = append(mounts, Mount{Path: t.TempDir()})
	}
	e := openEngine(t, Config{Mounts: mounts, Policy: newTestPolicy(1, 0), NodeID: "n"})
	_, c := declareSmall(t, e, 64)
	keys := testKeys("multi", 16)
	storeAndCheck(t, e, c, keys, blockLists(rand.New(rand.NewPCG(1, 1)), 16, 4, 0))
	e.Close(ctx)
	for i, m := range mounts {
		for k := range 8 {
			os.WriteFile(filepath.Join(m.Path, fmt.Sprintf(".tmp-n-%d-%016x", 1<<22+i, k)), nil, 0o644)
		}
	}
	e2 := openEngine(t, Config{Mounts: mounts, Policy: newTestPolicy(1, 0), NodeID: "n"})
	if st := e2.Stats(); st.Keys != 16 {
		t.Fatalf("keys after rebuild: %d", st.Keys)
	}
	for _, m := range mounts {
		if l := leftovers(t, m.Path); len(l) != 0 {
			t.Fatalf("leftovers of dead processes kept: %v", l)
		}
	}
}

// declareSmall declares smallGeometry(true) on e and registers a
// plane-first cache of numBlocks blocks for it.
func declareSmall(t testing.TB, e *Engine, numBlocks int) (NamespaceID, *testCache) {
	t.Helper()
	g := smallGeometry(true)
	ns, err := e.Declare(context.Background(), g)
	if err != nil {
		t.Fatalf("declare %+v: %v", g, err)
	}
	return ns, newTestCache(t, e, ns, g, numBlocks, layoutPlaneFirst)
}
