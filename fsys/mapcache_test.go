package fsys

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// countingFile counts its mappings and keeps the last one; afterMap, if
// set, runs after each.
type countingFile struct {
	File
	maps     int
	last     *Mapping
	afterMap func()
}

func (f *countingFile) MapRead(n int64) (*Mapping, error) {
	m, err := f.File.(Mapper).MapRead(n)
	if err == nil {
		f.maps++
		f.last = m
	}
	if f.afterMap != nil {
		f.afterMap()
	}
	return m, err
}

// unmapLog records the mappings a cache unmapped.
type unmapLog struct {
	mu   sync.Mutex
	done map[*Mapping]bool
	more chan struct{} // closed and replaced at each unmap
}

// watchUnmaps makes c record its unmaps in the returned log.
func watchUnmaps(c *MapCache) *unmapLog {
	l := &unmapLog{done: map[*Mapping]bool{}, more: make(chan struct{})}
	c.unmap = func(m *Mapping) {
		m.Close()
		l.mu.Lock()
		l.done[m] = true
		close(l.more)
		l.more = make(chan struct{})
		l.mu.Unlock()
	}
	return l
}

// await waits up to 10 s for the cache to unmap m.
func (l *unmapLog) await(t *testing.T, m *Mapping, what string) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		l.mu.Lock()
		done, more := l.done[m], l.more
		l.mu.Unlock()
		if done {
			return
		}
		select {
		case <-more:
		case <-deadline:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// unmapped reports whether the cache unmapped m.
func (l *unmapLog) unmapped(m *Mapping) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.done[m]
}

// cachedFile writes size patterned bytes to a new file in dir and returns
// it, counting its mappings, with its identity.
func cachedFile(t *testing.T, dir, name string, size int) (*countingFile, FileID, []byte) {
	t.Helper()
	f, err := OS{}.OpenFile(filepath.Join(dir, name), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	want := make([]byte, size)
	for i := range want {
		want[i] = byte(i*13 + len(name))
	}
	if _, err := f.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	return &countingFile{File: f}, FileIDOf(int(f.Fd()), &st), want
}

// readVia reads n bytes at off through the cache and releases them.
func readVia(t *testing.T, c *MapCache, f File, id FileID, size int64, off, n int) ([]byte, bool) {
	t.Helper()
	src, release, ok := c.Read(f, id, size)
	defer release()
	got := make([]byte, n)
	if _, err := src.ReadAt(got, int64(off)); err != nil {
		t.Fatalf("ReadAt through the cache: %v", err)
	}
	return got, ok
}

// TestMapCacheMapsAFileOnceForItsReads: reads of parts of one file share
// one mapping, with the file's bytes; a resized file, another file in its
// inode number's slot, and a file forgotten are mapped anew.
func TestMapCacheMapsAFileOnceForItsReads(t *testing.T) {
	const size = 5*4096 + 10
	c := NewMapCache(8, time.Hour)
	defer c.Close()
	u := watchUnmaps(c)
	f, id, want := cachedFile(t, t.TempDir(), "f", size)
	for _, off := range []int{0, 4096, size - 100} {
		got, ok := readVia(t, c, f, id, size, off, min(100, size-off))
		if !ok || !bytes.Equal(got, want[off:off+len(got)]) {
			t.Fatalf("read at %d through the cache: mapped %v, bytes equal %v", off, ok, bytes.Equal(got, want[off:off+len(got)]))
		}
	}
	if f.maps != 1 || c.Len() != 1 {
		t.Fatalf("three reads mapped the file %d times, the cache holds %d; want 1 and 1", f.maps, c.Len())
	}
	cases := []struct {
		name string
		id   FileID
		size int64
	}{
		{"resized", id, size - 10},
		{"another generation", FileID{Dev: id.Dev, Ino: id.Ino, Gen: id.Gen + "x"}, size - 10},
	}
	for i, tc := range cases {
		first := f.last
		if _, ok := readVia(t, c, f, tc.id, tc.size, 0, 10); !ok {
			t.Fatalf("%s: not mapped", tc.name)
		}
		if f.maps != 2+i || c.Len() != 1 || !u.unmapped(first) {
			t.Fatalf("%s: %d mappings made, %d cached, the old one unmapped %v; want %d, 1, true", tc.name, f.maps, c.Len(), u.unmapped(first), 2+i)
		}
	}
	c.Forget(FileID{Dev: id.Dev, Ino: id.Ino}) // any generation
	if c.Len() != 0 || !u.unmapped(f.last) {
		t.Fatalf("after Forget the cache holds %d, the mapping unmapped %v", c.Len(), u.unmapped(f.last))
	}
	readVia(t, c, f, id, size, 0, 10)
	if f.maps != 4 {
		t.Fatalf("a read after Forget: %d mappings in all, want 4", f.maps)
	}
}

// TestMapCacheKeepsAtMostItsLimit: a new file takes the place of the least
// recently used mapping no reader holds; where every one is held, it is
// read without a mapping.
func TestMapCacheKeepsAtMostItsLimit(t *testing.T) {
	c := NewMapCache(2, time.Hour)
	defer c.Close()
	u := watchUnmaps(c)
	dir := t.TempDir()
	a, ida, _ := cachedFile(t, dir, "a", 4096)
	b, idb, _ := cachedFile(t, dir, "b", 4096)
	d, idd, want := cachedFile(t, dir, "d", 4096)
	readVia(t, c, a, ida, 4096, 0, 1)
	_, releaseB, _ := c.Read(b, idb, 4096) // held
	if got, ok := readVia(t, c, d, idd, 4096, 0, 10); !ok || !bytes.Equal(got, want[:10]) {
		t.Fatalf("a third file: mapped %v", ok)
	}
	if c.Len() != 2 || !u.unmapped(a.last) || u.unmapped(b.last) {
		t.Fatalf("cache of 2: holds %d, the unused first file unmapped %v, the held one unmapped %v", c.Len(), u.unmapped(a.last), u.unmapped(b.last))
	}
	_, releaseD, _ := c.Read(d, idd, 4096) // both held now
	src, release, ok := c.Read(a, ida, 4096)
	got := make([]byte, 10)
	if _, err := src.ReadAt(got, 0); ok || src != File(a) || err != nil || a.maps != 1 {
		t.Fatalf("every mapping held: Read mapped %v, gave the file itself %v, read error %v, mappings made %d; want the file, no new mapping", ok, src == File(a), err, a.maps)
	}
	release()
	releaseB()
	releaseD()
}

// TestMapCacheDropsIdleMappings: a mapping no one read for the idle time
// is unmapped by the cache's own timer; one held is kept until released.
func TestMapCacheDropsIdleMappings(t *testing.T) {
	c := NewMapCache(8, 20*time.Millisecond)
	defer c.Close()
	u := watchUnmaps(c)
	dir := t.TempDir()
	a, ida, _ := cachedFile(t, dir, "a", 4096)
	b, idb, _ := cachedFile(t, dir, "b", 4096)
	readVia(t, c, a, ida, 4096, 0, 1)
	_, releaseB, _ := c.Read(b, idb, 4096)
	u.await(t, a.last, "the idle mapping dropped")
	if c.Len() != 1 || u.unmapped(b.last) {
		t.Fatalf("after the idle mapping's drop: %d cached, the one in use unmapped %v; want 1, false", c.Len(), u.unmapped(b.last))
	}
	releaseB()
	u.await(t, b.last, "the released mapping dropped once idle")
	if c.Len() != 0 {
		t.Fatalf("%d cached after both were dropped", c.Len())
	}
}

// TestMapCacheSweepDropsOnlyWhatWentIdle: a sweep (run here by hand, on
// the cache's clock) drops the mappings unused for the idle time, keeps
// the others and arms itself again for them; Close stops it.
func TestMapCacheSweepDropsOnlyWhatWentIdle(t *testing.T) {
	const idle = time.Hour
	c := NewMapCache(8, idle)
	u := watchUnmaps(c)
	now := time.Unix(1000, 0)
	c.now = func() time.Time { return now }
	dir := t.TempDir()
	a, ida, _ := cachedFile(t, dir, "a", 4096)
	b, idb, _ := cachedFile(t, dir, "b", 4096)
	readVia(t, c, a, ida, 4096, 0, 1) // unused from now
	now = now.Add(idle / 2)
	readVia(t, c, b, idb, 4096, 0, 1) // unused from half the idle time later
	armed := func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.timer != nil
	}
	cases := []struct {
		name           string
		advance        time.Duration
		len            int
		aGone, bGone   bool
		armedAfterward bool
	}{
		{"neither idle yet", idle / 4, 2, false, false, true},
		{"the first idle", idle / 4, 1, true, false, true},
		{"both idle", idle / 2, 0, true, true, false},
	}
	for _, tc := range cases {
		now = now.Add(tc.advance)
		c.sweep()
		if c.Len() != tc.len || u.unmapped(a.last) != tc.aGone || u.unmapped(b.last) != tc.bGone || armed() != tc.armedAfterward {
			t.Fatalf("%s: %d cached, first unmapped %v, second %v, a sweep armed %v; want %d, %v, %v, %v",
				tc.name, c.Len(), u.unmapped(a.last), u.unmapped(b.last), armed(), tc.len, tc.aGone, tc.bGone, tc.armedAfterward)
		}
	}
	readVia(t, c, a, ida, 4096, 0, 1)
	if !armed() {
		t.Fatal("a release armed no sweep")
	}
	c.Close()
	if armed() || c.Len() != 0 {
		t.Fatalf("after Close: a sweep armed %v, %d cached", armed(), c.Len())
	}
}

// TestMapCacheReadersOutliveForgetAndClose: a reader holding a mapping
// reads on after Forget and Close, which unmap it at its release; reads
// after Close are not mapped; a file truncated under its mapping fails
// the read with ErrMapping.
func TestMapCacheReadersOutliveForgetAndClose(t *testing.T) {
	dir := t.TempDir()
	for _, end := range []string{"forget", "close"} {
		t.Run(end, func(t *testing.T) {
			c := NewMapCache(8, time.Hour)
			defer c.Close()
			u := watchUnmaps(c)
			f, id, want := cachedFile(t, dir, end, 3*4096)
			src, release, ok := c.Read(f, id, 3*4096)
			if !ok {
				t.Fatal("not mapped")
			}
			if end == "forget" {
				c.Forget(id)
			} else {
				c.Close()
			}
			got := make([]byte, 4096)
			if _, err := src.ReadAt(got, 4096); err != nil || !bytes.Equal(got, want[4096:8192]) {
				t.Fatalf("a held mapping after %s: %v", end, err)
			}
			if u.unmapped(f.last) {
				t.Fatalf("a held mapping was unmapped by %s", end)
			}
			release()
			if !u.unmapped(f.last) {
				t.Fatalf("after %s and the release the mapping is still mapped", end)
			}
			if end == "close" {
				if _, _, ok := c.Read(f, id, 3*4096); ok {
					t.Fatal("a read after Close was mapped")
				}
			}
		})
	}
	t.Run("truncated", func(t *testing.T) {
		c := NewMapCache(8, time.Hour)
		defer c.Close()
		f, id, _ := cachedFile(t, dir, "trunc", 3*4096)
		readVia(t, c, f, id, 3*4096, 0, 1)
		if err := os.Truncate(filepath.Join(dir, "trunc"), 4096); err != nil {
			t.Fatal(err)
		}
		src, release, _ := c.Read(f, id, 3*4096) // the caller's identity is stale
		defer release()
		if _, err := src.ReadAt(make([]byte, 10), 2*4096); !errors.Is(err, ErrMapping) {
			t.Fatalf("a read past the truncated end: %v, want ErrMapping", err)
		}
	})
}

// TestMapCacheCachesNoMappingThatMayBeWrong: a file truncated between
// the caller's fstat and its mapping, and a file forgotten while it was
// mapped (the engine removing it), are read without a mapping, and none
// is kept.
func TestMapCacheCachesNoMappingThatMayBeWrong(t *testing.T) {
	dir := t.TempDir()
	cases := []struct {
		name     string
		afterMap func(c *MapCache, path string, id FileID)
	}{
		{"truncated", func(_ *MapCache, path string, _ FileID) {}},
		{"forgotten", func(c *MapCache, _ string, id FileID) { c.Forget(id) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := NewMapCache(8, time.Hour)
			defer c.Close()
			u := watchUnmaps(c)
			f, id, _ := cachedFile(t, dir, tc.name, 3*4096)
			size := int64(3 * 4096)
			if tc.name == "truncated" {
				if err := os.Truncate(filepath.Join(dir, tc.name), 4096); err != nil {
					t.Fatal(err)
				}
			}
			f.afterMap = func() { tc.afterMap(c, filepath.Join(dir, tc.name), id) }
			src, release, ok := c.Read(f, id, size)
			release()
			if ok || src != File(f) || c.Len() != 0 || f.maps != 1 || !u.unmapped(f.last) {
				t.Fatalf("mapped %v, the file itself %v, cached %d, mappings made %d, unmapped %v; want the file, none cached, the one made unmapped",
					ok, src == File(f), c.Len(), f.maps, u.unmapped(f.last))
			}
		})
	}
}
