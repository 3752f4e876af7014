//go:build linux

package gds

import (
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/testwait"
)

// goFake is a cuFile stand-in for the handle cache's tests: it tracks live
// handles and counts every misuse (I/O on or deregistration of a handle
// that is not live).
type goFake struct {
	mu         sync.Mutex
	next       uintptr
	live       map[uintptr]int // handle → fd
	violations int
}

func newGoFake() *goFake { return &goFake{live: map[uintptr]int{}, next: 1} }

func (g *goFake) path() string                                      { return "go-fake" }
func (g *goFake) driverOpen() error                                 { return nil }
func (g *goFake) driverClose() error                                { return nil }
func (g *goFake) properties() (rawProps, bool, error)               { return rawProps{}, false, nil }
func (g *goFake) version() (int, bool, error)                       { return 0, false, nil }
func (g *goFake) hasBatch() bool                                    { return false }
func (g *goFake) batchSetUp(int) (batchCtx, error)                  { return nil, ErrUnavailable }
func (g *goFake) unload() error                                     { return nil }
func (g *goFake) write(h, b uintptr, n, o, bo int64) (int64, error) { return g.read(h, b, n, o, bo) }

func (g *goFake) handleRegister(fd int) (uintptr, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	h := g.next
	g.next++
	g.live[h] = fd
	return h, nil
}

func (g *goFake) handleDeregister(h uintptr) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.live[h]; !ok {
		g.violations++
	}
	delete(g.live, h)
}

func (g *goFake) read(h, _ uintptr, n, _, _ int64) (int64, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.live[h]; !ok {
		g.violations++
		return 0, StatusHandleNotRegistered
	}
	return n, nil
}

func (g *goFake) counts() (live, violations int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.live), g.violations
}

// openGoAPI opens a driver over a Go stand-in for cuFile (a goFake, or
// one built on it), on a platform without nvidia-fs or a cufile.json:
// compat mode, allowed.
func openGoAPI(t *testing.T, a api) *Driver {
	t.Helper()
	d, err := openAPI(a, Config{Logger: slog.New(slog.DiscardHandler), NVFSPath: filepath.Join(t.TempDir(), "none"), ConfigJSON: filepath.Join(t.TempDir(), "none.json")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// openFiles creates n files and opens them read-write.
func openFiles(t *testing.T, n int) []*os.File {
	t.Helper()
	dir := t.TempDir()
	fs := make([]*os.File, n)
	for i := range fs {
		f, err := os.OpenFile(filepath.Join(dir, fmt.Sprint(i)), os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		fs[i] = f
	}
	return fs
}

func acquireFile(t testing.TB, c *handleCache, f *os.File) *handle {
	key, err := c.identify(int(f.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	h, err := c.acquire(int(f.Fd()), key)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func TestHandleCacheHammerNeverUsesADeregisteredHandle(t *testing.T) {
	const files, max, goroutines, loops = 8, 3, 8, 400
	fs := openFiles(t, files)
	g := newGoFake()
	c := newHandleCache(g, max)
	var wg sync.WaitGroup
	for p := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(p), 7))
			for range loops {
				f := fs[r.IntN(files)]
				key, err := c.identify(int(f.Fd()))
				if err != nil {
					t.Error(err)
					return
				}
				if r.IntN(10) == 0 {
					c.forget(key.FileID)
					continue
				}
				h, err := c.acquire(int(f.Fd()), key)
				if err != nil {
					t.Error(err)
					return
				}
				if _, err := g.read(h.h, 0, 4096, 0, 0); err != nil {
					t.Errorf("read through an acquired handle: %v", err)
				}
				c.release(h)
			}
		}()
	}
	wg.Wait()
	live, violations := g.counts()
	st := c.stats()
	if violations != 0 {
		t.Fatalf("%d uses or deregistrations of dead handles", violations)
	}
	if st.Cached > max || live != st.Cached {
		t.Fatalf("after the hammer: %d cached (bound %d), %d live in cuFile", st.Cached, max, live)
	}
	if st.Evictions == 0 || st.Forgotten == 0 || st.Hits == 0 {
		t.Fatalf("the hammer did not exercise eviction, forget and hits: %+v", st)
	}
	c.close()
	if live, _ := g.counts(); live != 0 {
		t.Fatalf("%d handles live after close", live)
	}
}

func TestHandleCacheEvictionNeverDeregistersAReferencedHandle(t *testing.T) {
	const max = 2
	fs := openFiles(t, 8)
	g := newGoFake()
	c := newHandleCache(g, max)
	var held []*handle
	for _, f := range fs[:5] {
		held = append(held, acquireFile(t, c, f))
	}
	// Churn through the other files: every release now is over the bound.
	for range 3 {
		for _, f := range fs[5:] {
			c.release(acquireFile(t, c, f))
		}
	}
	for i, h := range held {
		if _, err := g.read(h.h, 0, 1, 0, 0); err != nil {
			t.Fatalf("held handle %d was deregistered: %v", i, err)
		}
	}
	if st := c.stats(); st.Cached < len(held) {
		t.Fatalf("%d cached, fewer than the %d held", st.Cached, len(held))
	}
	for _, h := range held {
		c.release(h)
	}
	live, violations := g.counts()
	if st := c.stats(); st.Cached != max || live != max || violations != 0 {
		t.Fatalf("after release: cached %d, live %d, violations %d; want %d, %d, 0", st.Cached, live, violations, max, max)
	}
}

func TestHandleCacheForgetDefersDeregistrationOfAHeldHandle(t *testing.T) {
	fs := openFiles(t, 1)
	g := newGoFake()
	c := newHandleCache(g, 4)
	h := acquireFile(t, c, fs[0])
	c.forget(h.key.FileID)
	if _, err := g.read(h.h, 0, 1, 0, 0); err != nil {
		t.Fatalf("forget deregistered a held handle: %v", err)
	}
	h2 := acquireFile(t, c, fs[0])
	if h2 == h {
		t.Fatal("a forgotten handle was served again")
	}
	c.release(h)
	c.release(h2)
	if live, _ := g.counts(); live != 1 {
		t.Fatalf("%d live handles, want 1 (the forgotten one deregistered on release)", live)
	}
}

func TestHandleCacheKeysByAccessMode(t *testing.T) {
	fs := openFiles(t, 1)
	ro, err := os.Open(fs[0].Name())
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	g := newGoFake()
	c := newHandleCache(g, 4)
	hw := acquireFile(t, c, fs[0])
	hr := acquireFile(t, c, ro)
	if hw == hr {
		t.Fatal("a read-only descriptor got the read-write descriptor's handle")
	}
	c.release(hw)
	c.release(hr)
	c.forget(hw.key.FileID)
	if live, _ := g.counts(); live != 0 {
		t.Fatalf("forget left %d handles of the file", live)
	}
}

func TestHandleCacheDeregistersOnALockedDeviceThread(t *testing.T) {
	fs := openFiles(t, 3)
	g := newGoFake()
	c := newHandleCache(g, 2)
	onThread := 0
	c.onThread = func(f func() error) error { onThread++; return f() }
	held := acquireFile(t, c, fs[0])
	c.release(acquireFile(t, c, fs[1]))
	c.release(acquireFile(t, c, fs[2])) // over the bound: one evicted
	c.forget(held.key.FileID)
	c.release(held) // forgotten: deregistered at its last release
	if st := c.stats(); st.Cached != 1 || onThread != 2 {
		t.Fatalf("before close: %d cached, %d deregistrations on a device thread; want 1 and 2", st.Cached, onThread)
	}
	c.close() // the cached one
	if live, _ := g.counts(); live != 0 || onThread != 3 {
		t.Fatalf("%d handles live, %d deregistrations on a device thread; want 0 and 3", live, onThread)
	}
}

func TestDriverDeregistersHandlesOnADeviceBoundThread(t *testing.T) {
	fs := openFiles(t, 2)
	g := newGoFake()
	binds := 0
	d, err := openAPI(g, Config{MaxHandles: 1, Logger: slog.New(slog.DiscardHandler), NVFSPath: filepath.Join(t.TempDir(), "none"),
		BindDevice: func(ordinal int) error {
			if ordinal != 0 {
				t.Errorf("bound device %d, want 0", ordinal)
			}
			binds++
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	before := binds // the driver's own open
	d.cache.release(acquireFile(t, d.cache, fs[0]))
	d.cache.release(acquireFile(t, d.cache, fs[1])) // evicts the first
	if binds-before != 1 {
		t.Fatalf("%d binds for one eviction's deregistration, want 1", binds-before)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if live, _ := g.counts(); live != 0 {
		t.Fatalf("%d handles live after Close", live)
	}
}

func TestHandleCacheDropsHandlesOfFilesAnotherNodeRemoved(t *testing.T) {
	fs := openFiles(t, 4)
	g := newGoFake()
	c := newHandleCache(g, 8)
	c.sweepEvery = 0 // every registration sweeps
	for _, f := range fs[:3] {
		c.release(acquireFile(t, c, f))
	}
	held := acquireFile(t, c, fs[2]) // held: never dropped under a transfer
	// Another node removes two of the files; this engine forgets neither.
	for _, f := range fs[1:3] {
		if err := os.Remove(f.Name()); err != nil {
			t.Fatal(err)
		}
	}
	c.release(acquireFile(t, c, fs[3])) // a registration: sweeps, in the background
	// The sweep counts a dropped handle before its deregistration
	// returns (on a thread of the handle's device): wait for both.
	testwait.Until(t, "the idle handle of a removed file dropped and deregistered", testwait.Hang, func() bool {
		st := c.stats()
		live, _ := g.counts()
		return st.Unlinked == 1 && st.Cached == 3 && live == 3
	})
	if _, err := g.read(held.h, 0, 1, 0, 0); err != nil {
		t.Fatalf("the held handle of a removed file was deregistered under its transfer: %v", err)
	}
	c.release(held)
	other, err := os.CreateTemp(t.TempDir(), "x")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	c.release(acquireFile(t, c, other)) // a registration: the released one goes now
	testwait.Until(t, "the released handle of the other removed file dropped and deregistered (3 live: files 0 and 3, and the new one)", testwait.Hang, func() bool {
		st := c.stats()
		live, _ := g.counts()
		return st.Unlinked == 2 && st.Cached == 3 && live == 3
	})
}

func TestHandleCacheSweepsForRemovedFilesAtMostOnceASecond(t *testing.T) {
	fs := openFiles(t, 3)
	c := newHandleCache(newGoFake(), 8)
	lastSweep := func() time.Time {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.lastSweep
	}
	c.release(acquireFile(t, c, fs[0])) // the first registration sweeps
	first := lastSweep()
	if first.IsZero() {
		t.Fatal("the first registration did not sweep")
	}
	if err := os.Remove(fs[0].Name()); err != nil {
		t.Fatal(err)
	}
	// A registration within the second does not sweep. The machine may
	// be slow enough that the second has passed by now: the check is on
	// the sweeps' times, not on how fast this registration comes, so a
	// sweep counts against the bound only if it began within sweepEvery
	// of the last one.
	c.release(acquireFile(t, c, fs[1]))
	if got := lastSweep(); !got.Equal(first) && got.Sub(first) < sweepEvery {
		t.Fatalf("a registration %v after the last sweep swept again (at most one sweep per %v)", got.Sub(first), sweepEvery)
	}
	c.mu.Lock()
	c.lastSweep = c.lastSweep.Add(-sweepEvery)
	c.mu.Unlock()
	c.release(acquireFile(t, c, fs[2])) // a second later: sweeps
	testwait.Until(t, "the removed file's handle dropped once the period passed", testwait.Hang, func() bool {
		st := c.stats()
		return st.Unlinked == 1 && st.Cached == 2
	})
}

// fdIno is the inode number the file system gives the file open at fd.
func fdIno(t testing.TB, fd int) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// TestHandleCacheServesAHandleOnlyToItsOwnFile: where the file system
// gives a new file the inode number of one removed behind the engine's
// back (NFS after another node's remove; tmpfs after its 32-bit inode
// numbers wrap), the cached handle of the removed file must not be served
// for the new one: its transfers would move the bytes of a dead file. The
// injected stat reports one inode number for every file.
func TestHandleCacheServesAHandleOnlyToItsOwnFile(t *testing.T) {
	for _, tc := range []struct {
		name    string
		reopen  bool // acquire the first file again, else the second
		wantReg int
	}{
		{"the same file again is served its cached handle", true, 1},
		{"another file with the inode number gets a handle of its own", false, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := openFiles(t, 2)
			g := newGoFake()
			c := newHandleCache(g, 8)
			c.fstat = func(fd int, st *unix.Stat_t) error {
				err := unix.Fstat(fd, st)
				st.Ino = 42
				return err
			}
			// No sweep: it would drop the removed file's idle handle
			// before the second acquisition finds it.
			c.lastSweep, c.sweepEvery = time.Now(), time.Hour
			c.release(acquireFile(t, c, fs[0]))
			want := fs[1]
			if tc.reopen {
				want = fs[0]
			} else if err := os.Remove(fs[0].Name()); err != nil { // behind the engine's back: no Forget
				t.Fatal(err)
			}
			h := acquireFile(t, c, want)
			defer c.release(h)
			g.mu.Lock()
			fd := g.live[h.h]
			g.mu.Unlock()
			if got, wantIno := fdIno(t, fd), fdIno(t, int(want.Fd())); got != wantIno {
				t.Fatalf("the handle served is registered over inode %d, the file acquired is inode %d", got, wantIno)
			}
			if st := c.stats(); st.Registrations != uint64(tc.wantReg) || st.Reused != uint64(tc.wantReg-1) {
				t.Fatalf("%d registrations, %d handles of a reused inode number dropped; want %d and %d", st.Registrations, st.Reused, tc.wantReg, tc.wantReg-1)
			}
		})
	}
}

// TestHandleCacheSweepOfAHungFileSystemRunsOneGoroutine: on a network
// file system that stopped answering, every sweep's fstat hangs; a
// registration must not start another sweep while one is still running,
// or every registration leaves one more goroutine (and thread) behind.
func TestHandleCacheSweepOfAHungFileSystemRunsOneGoroutine(t *testing.T) {
	const registrations = 50
	fs := openFiles(t, registrations+1)
	var (
		hangMu  sync.Mutex
		hangFds = map[int]bool{}
		entered atomic.Int32
		unblock = make(chan struct{})
	)
	g := newGoFake()
	c := newHandleCache(g, 2*registrations)
	c.sweepEvery = 0 // every registration sweeps
	c.fstat = func(fd int, st *unix.Stat_t) error {
		hangMu.Lock()
		hang := hangFds[fd]
		hangMu.Unlock()
		if hang {
			entered.Add(1)
			<-unblock
		}
		return unix.Fstat(fd, st)
	}
	// The first file's cached descriptor is on the hung file system.
	h := acquireFile(t, c, fs[0])
	hangMu.Lock()
	hangFds[h.fd] = true
	hangMu.Unlock()
	c.release(h)
	base := runtime.NumGoroutine()
	c.release(acquireFile(t, c, fs[1]))
	testwait.Until(t, "a sweep stuck in the hung fstat", testwait.Hang, func() bool { return entered.Load() >= 1 })
	for _, f := range fs[2:] {
		c.release(acquireFile(t, c, f))
	}
	if n := runtime.NumGoroutine() - base; n > 2 {
		t.Errorf("%d more goroutines after %d registrations beside a hung sweep; want at most the one sweep (and a spare)", n, registrations)
	}
	if n := entered.Load(); n > 1 {
		t.Errorf("%d sweeps entered the hung fstat; want 1", n)
	}
	close(unblock)
	testwait.Until(t, "the sweeps ended once the file system answered", testwait.Hang, func() bool {
		return runtime.NumGoroutine() <= base
	})
	c.close()
}
