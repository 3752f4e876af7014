//go:build linux && cgo

package gds

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// sparsePlan lays pages of pageSize out in file order from random even
// page slots of dev: no two pages are adjacent in memory, so every page is
// a piece of its own (vLLM's paged layout).
func sparsePlan(dev region.Device, pages, pageSize int, seed uint64) *transfer.Plan {
	perm := rand.New(rand.NewPCG(seed, 7)).Perm(int(dev.Len()) / pageSize / 2)
	p := &transfer.Plan{}
	for i := range pages {
		p.Extents = append(p.Extents, transfer.Extent{
			FileOff: int64(i * pageSize), Region: dev, RegionOff: int64(perm[i]*2) * int64(pageSize), Len: int64(pageSize), Sum: -1,
		})
	}
	return p
}

// waitFor polls cond until it holds or testwait.Hang passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testwait.Until(t, what, testwait.Hang, cond)
}

// roundTrip writes p from src, reads it back into a poisoned dst and
// checks the bytes.
func roundTrip(t *testing.T, m *Mover, path string, p *transfer.Plan, src, dst *hostDevice) {
	t.Helper()
	f := openFile(t, path, os.O_RDWR)
	ctx := context.Background()
	if n, err := m.WriteFile(ctx, f, p, nil); err != nil || n != p.Bytes() {
		t.Fatalf("WriteFile = %d, %v; want %d", n, err, p.Bytes())
	}
	file, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(file, gather(p, src.mem)) {
		t.Fatal("file bytes differ from the plan's gather of device memory")
	}
	for i := range dst.mem {
		dst.mem[i] = 0xA5
	}
	rp := retarget(p, dst)
	if n, err := m.ReadFile(ctx, f, rp, nil); err != nil || n != rp.Bytes() {
		t.Fatalf("ReadFile = %d, %v; want %d", n, err, rp.Bytes())
	}
	if !bytes.Equal(gather(rp, dst.mem), gather(p, src.mem)) {
		t.Fatal("bytes read back differ from the bytes written")
	}
}

func TestMoverBatchRoundTripsInBatchesOfAtMostTheBatchSize(t *testing.T) {
	tests := []struct {
		name        string
		pages, page int
		batchSize   int
		maxIO       int64
		wantBatches int64 // per direction
		wantMax     int64
	}{
		{"512 pages at the driver's 128", 512, 4096, 0, 0, 4, 128},
		{"130 pages split evenly", 130, 4096, 128, 0, 2, 65},
		{"32 pages in one batch", 32, 8192, 0, 0, 1, 32},
		{"pages split at MaxIO", 16, 16384, 8, 4096, 8, 8},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := openFake(t, Config{}, nil)
			m := newMover(t, e.d, MoverConfig{Workers: 3, AllowCompat: true, IO: IOBatch, BatchSize: tt.batchSize, MaxIO: tt.maxIO})
			size := tt.pages * tt.page * 2
			src, dst := newHostDevice(t, 1, size, 0), newHostDevice(t, 2, size, 0)
			fill(src.mem, 11)
			dir := t.TempDir()
			for i := range 3 {
				roundTrip(t, m, filepath.Join(dir, string(rune('a'+i))), sparsePlan(src, tt.pages, tt.page, uint64(i)), src, dst)
			}
			c := e.ctl
			if s := c.get(&c.BatchSubmits); s != 3*2*tt.wantBatches {
				t.Errorf("%d batches for 3 round trips; want %d", s, 3*2*tt.wantBatches)
			}
			if mx := c.get(&c.BatchMaxEntries); mx != tt.wantMax {
				t.Errorf("largest batch %d entries; want %d", mx, tt.wantMax)
			}
			if r, w := c.get(&c.Reads), c.get(&c.Writes); r != 0 || w != 0 {
				t.Errorf("%d cuFileRead and %d cuFileWrite calls in batch mode; want none", r, w)
			}
			if su := c.get(&c.BatchSetups); su > 3 {
				t.Errorf("%d batch contexts set up by 3 workers; want at most 3 (reused)", su)
			}
			if bad := c.get(&c.BatchBadUses) + c.get(&c.BadHandleUses); bad != 0 {
				t.Errorf("%d bad uses of batch contexts or handles", bad)
			}
			if st := e.d.batchStats(); st.Batches != uint64(3*2*tt.wantBatches) || st.Refusals != 0 || st.Short != 0 {
				t.Errorf("batchStats = %+v", st)
			}
			ctl := e.ctl
			if err := m.Close(); err != nil {
				t.Fatal(err)
			}
			if live := ctl.get(&ctl.BatchLive); live != 0 {
				t.Errorf("%d batch contexts live after the mover closed", live)
			}
		})
	}
}

func TestMoverBatchRefusalFallsBackPerCallAndIsLoggedOnce(t *testing.T) {
	tests := []struct {
		name  string
		setup func(c *fakeCtl)
	}{
		{"setup refused (compat mode)", func(c *fakeCtl) { c.set(&c.BatchSetupError, int64(statusBatchNoCompatError)) }},
		{"submit refused (compat mode)", func(c *fakeCtl) { c.set(&c.BatchSubmitError, int64(statusBatchNoCompatError)) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := openFake(t, Config{}, tt.setup)
			m := newMover(t, e.d, MoverConfig{Workers: 2, AllowCompat: true, IO: IOBatch, BatchSize: 16})
			src, dst := newHostDevice(t, 1, 1<<20, 0), newHostDevice(t, 2, 1<<20, 0)
			fill(src.mem, 12)
			dir := t.TempDir()
			for i := range 3 {
				roundTrip(t, m, filepath.Join(dir, string(rune('a'+i))), sparsePlan(src, 48, 4096, uint64(i)), src, dst)
			}
			c := e.ctl
			if w, r := c.get(&c.Writes), c.get(&c.Reads); w == 0 || r == 0 {
				t.Fatalf("%d writes, %d reads per call; the refused batches must go per call", w, r)
			}
			if ent := c.get(&c.BatchEntries); ent != 0 {
				t.Fatalf("%d batch entries accepted on a mount that refuses batches", ent)
			}
			logs := e.logs.String()
			if n := strings.Count(logs, "batch I/O refused"); n != 1 || !strings.Contains(logs, "CU_FILE_BATCH_NOCOMPAT_ERROR (5049)") {
				t.Fatalf("refusal logged %d times, want once with 5049; logs:\n%s", n, logs)
			}
			st := e.d.batchStats()
			if st.Refusals != 1 || st.Fallbacks < 5 {
				t.Fatalf("batchStats = %+v; want 1 refusal and a fallback for each later job", st)
			}
			capab, err := e.d.capability(dir)
			if err != nil || capab.batch != batchStateRefused || !errors.Is(capab.batchErr, statusBatchNoCompatError) {
				t.Fatalf("Capability = %+v, %v; want batch refused with 5049", capab, err)
			}
		})
	}
}

func TestMoverBatchFailuresFailTheJob(t *testing.T) {
	tests := []struct {
		name  string
		write bool
		setup func(c *fakeCtl, entries int64)
		check func(err error) bool
	}{
		{"read entry fails with a cuFile status", false, func(c *fakeCtl, entries int64) {
			c.set(&c.BatchFailCode, int64(statusIOError))
			c.set(&c.BatchFailEntry, entries+5)
		}, func(err error) bool { return errors.Is(err, errBatchEntry) && errors.Is(err, statusIOError) }},
		{"write entry fails with an errno", true, func(c *fakeCtl, entries int64) {
			c.set(&c.BatchFailCode, int64(syscall.EIO))
			c.set(&c.BatchFailEntry, entries+20)
		}, func(err error) bool { return errors.Is(err, errBatchEntry) && errors.Is(err, syscall.EIO) }},
		{"submit fails with an internal error", true, func(c *fakeCtl, _ int64) {
			c.set(&c.BatchSubmitError, int64(statusInternalError))
		}, func(err error) bool { return errors.Is(err, statusInternalError) }},
		{"read past the end of the file", false, func(c *fakeCtl, _ int64) {
			c.set(&c.ReadTruncateAt, 10*4096+100)
		}, func(err error) bool {
			return errors.Is(err, transfer.ErrShortFile) && errors.Is(err, io.ErrUnexpectedEOF)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := openFake(t, Config{}, nil)
			m := newMover(t, e.d, MoverConfig{Workers: 2, AllowCompat: true, IO: IOBatch, BatchSize: 16})
			src := newHostDevice(t, 1, 1<<20, 0)
			fill(src.mem, 13)
			p := sparsePlan(src, 48, 4096, 1)
			f := openFile(t, filepath.Join(t.TempDir(), "key"), os.O_RDWR)
			ctx := context.Background()
			if _, err := m.WriteFile(ctx, f, p, nil); err != nil {
				t.Fatal(err)
			}
			tt.setup(e.ctl, e.ctl.get(&e.ctl.BatchEntries))
			perCall := e.ctl.get(&e.ctl.Writes) + e.ctl.get(&e.ctl.Reads)
			var n int64
			var err error
			if tt.write {
				n, err = m.WriteFile(ctx, f, p, nil)
			} else {
				n, err = m.ReadFile(ctx, f, retarget(p, newHostDevice(t, 2, 1<<20, 0)), nil)
			}
			if err == nil || n >= p.Bytes() {
				t.Fatalf("transfer = %d, %v; a failure reported success", n, err)
			}
			if errors.Is(err, transfer.ErrUnsupported) || !tt.check(err) {
				t.Fatalf("transfer error %v: wrong kind (must fail with the cause, not fall back)", err)
			}
			if e.d.batchStats().Refusals != 0 {
				t.Fatal("a failure was taken for a refusal")
			}
			if tt.name != "read past the end of the file" {
				if pc := e.ctl.get(&e.ctl.Writes) + e.ctl.get(&e.ctl.Reads); pc != perCall {
					t.Fatalf("%d per-call I/Os after a batch failure; a failure must not be retried another way", pc-perCall)
				}
			}
		})
	}
}

// A batch context whose submission failed (not a refusal) is in a state
// no one knows: it is destroyed, and the next batch sets up a fresh one.
func TestMoverDropsABatchContextWhoseSubmitFailed(t *testing.T) {
	e := openFake(t, Config{}, nil)
	m := newMover(t, e.d, MoverConfig{Workers: 1, AllowCompat: true, IO: IOBatch, BatchSize: 16})
	src := newHostDevice(t, 1, 1<<20, 0)
	p := sparsePlan(src, 16, 4096, 1)
	f := openFile(t, filepath.Join(t.TempDir(), "key"), os.O_RDWR)
	ctx := context.Background()
	c := e.ctl
	if _, err := m.WriteFile(ctx, f, p, nil); err != nil {
		t.Fatal(err)
	}
	c.set(&c.BatchSubmitError, int64(statusInternalError))
	if _, err := m.WriteFile(ctx, f, p, nil); !errors.Is(err, statusInternalError) {
		t.Fatalf("WriteFile with the submission failing = %v", err)
	}
	c.set(&c.BatchSubmitError, 0)
	if _, err := m.WriteFile(ctx, f, p, nil); err != nil {
		t.Fatal(err)
	}
	if su, d := c.get(&c.BatchSetups), c.get(&c.BatchDestroys); su != 2 || d != 1 {
		t.Errorf("%d contexts set up, %d destroyed; want 2, 1 (the failed one not reused)", su, d)
	}
}

func TestMoverBatchShortEntryIsFinishedPerCall(t *testing.T) {
	for _, write := range []bool{false, true} {
		name := "read"
		if write {
			name = "write"
		}
		t.Run(name, func(t *testing.T) {
			e := openFake(t, Config{}, nil)
			m := newMover(t, e.d, MoverConfig{Workers: 2, AllowCompat: true, IO: IOBatch, BatchSize: 16})
			src, dst := newHostDevice(t, 1, 1<<20, 0), newHostDevice(t, 2, 1<<20, 0)
			fill(src.mem, 14)
			p := sparsePlan(src, 40, 4096, 2)
			path := filepath.Join(t.TempDir(), "key")
			f := openFile(t, path, os.O_RDWR)
			ctx := context.Background()
			c := e.ctl
			if write {
				c.set(&c.BatchShortEntry, 7)
			}
			if n, err := m.WriteFile(ctx, f, p, nil); err != nil || n != p.Bytes() {
				t.Fatalf("WriteFile = %d, %v", n, err)
			}
			if !write {
				c.set(&c.BatchShortEntry, c.get(&c.BatchEntries)+7)
			}
			rp := retarget(p, dst)
			if n, err := m.ReadFile(ctx, f, rp, nil); err != nil || n != rp.Bytes() {
				t.Fatalf("ReadFile = %d, %v", n, err)
			}
			if !bytes.Equal(gather(rp, dst.mem), gather(p, src.mem)) {
				t.Fatal("bytes differ after a short entry")
			}
			if st := e.d.batchStats(); st.Short != 1 {
				t.Fatalf("batchStats.Short = %d, want 1", st.Short)
			}
			if pc := c.get(&c.Writes) + c.get(&c.Reads); pc != 1 {
				t.Fatalf("%d per-call I/Os; want 1 for the short entry's rest", pc)
			}
		})
	}
}

func TestMoverBatchCancelsOnContextDoneAndTimeout(t *testing.T) {
	tests := []struct {
		name    string
		timeout time.Duration
		cancel  bool
		want    error
	}{
		{"context canceled", time.Minute, true, context.Canceled},
		{"batch timeout", 30 * time.Millisecond, false, errBatchTimeout},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := openFake(t, Config{}, nil)
			m := newMover(t, e.d, MoverConfig{Workers: 1, AllowCompat: true, IO: IOBatch, BatchTimeout: tt.timeout})
			src := newHostDevice(t, 1, 1<<20, 0)
			fill(src.mem, 15)
			p := sparsePlan(src, 32, 4096, 3)
			f := openFile(t, filepath.Join(t.TempDir(), "key"), os.O_RDWR)
			c := e.ctl
			c.set(&c.BatchHold, 1)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			type result struct {
				n   int64
				err error
			}
			res := make(chan result, 1)
			go func() {
				n, err := m.WriteFile(ctx, f, p, nil)
				res <- result{n, err}
			}()
			if tt.cancel {
				waitFor(t, "entries pending", func() bool { return c.get(&c.BatchPending) == 32 })
				cancel()
			}
			r := <-res
			if !errors.Is(r.err, tt.want) || r.n != 0 {
				t.Fatalf("WriteFile = %d, %v; want 0, %v", r.n, r.err, tt.want)
			}
			if cn, live, pend := c.get(&c.BatchCancels), c.get(&c.BatchLive), c.get(&c.BatchPending); cn != 1 || live != 0 || pend != 0 {
				t.Fatalf("after the abandoned batch: %d cancels, %d contexts live, %d entries pending; want 1, 0, 0", cn, live, pend)
			}
			c.set(&c.BatchHold, 0)
			if n, err := m.WriteFile(context.Background(), f, p, nil); err != nil || n != p.Bytes() {
				t.Fatalf("WriteFile after the abandoned batch = %d, %v", n, err)
			}
			if su := c.get(&c.BatchSetups); su != 2 {
				t.Fatalf("%d contexts set up; want 2 (the abandoned one is not reused)", su)
			}
			if st := e.d.batchStats(); st.Abandoned != 1 || st.Stuck != 0 {
				t.Fatalf("batchStats.Abandoned = %d, Stuck = %d; want 1, 0", st.Abandoned, st.Stuck)
			}
		})
	}
}

// TestMoverHoldsAJobWhoseCanceledBatchNeverComesBack: when a batch's
// entries do not come back after cuFileBatchIOCancel, the library may still
// move bytes into the job's memory through the job's handle, so the job
// does not end: its handle stays registered (even once the file is
// forgotten), its context is not destroyed, and the device is counted as
// faulted, which makes the daemon unready. When the entries come back at
// last, their bytes have landed, the job fails with the timeout, and only
// then are the handle and the context let go.
func TestMoverHoldsAJobWhoseCanceledBatchNeverComesBack(t *testing.T) {
	e := openFake(t, Config{}, nil)
	m := newMover(t, e.d, MoverConfig{Workers: 1, AllowCompat: true, IO: IOBatch, BatchTimeout: 30 * time.Millisecond})
	src, dst := newHostDevice(t, 1, 1<<20, 0), newHostDevice(t, 2, 1<<20, 0)
	fill(src.mem, 15)
	for i := range dst.mem {
		dst.mem[i] = 0xA5
	}
	p := sparsePlan(src, 32, 4096, 3)
	path := filepath.Join(t.TempDir(), "key")
	f := openFile(t, path, os.O_RDWR)
	if n, err := m.WriteFile(context.Background(), f, p, nil); err != nil || n != p.Bytes() {
		t.Fatalf("WriteFile = %d, %v", n, err)
	}
	c := e.ctl
	c.set(&c.BatchHold, 1)
	c.set(&c.BatchCancelIgnored, 1)
	type result struct {
		n   int64
		err error
	}
	res, returned := make(chan result, 1), make(chan struct{})
	rp := retarget(p, dst)
	go func() {
		n, err := m.ReadFile(context.Background(), f, rp, nil)
		res <- result{n, err}
		close(returned)
	}()
	// Whatever fails below, the held entries run (into dst) before its
	// memory is unmapped and the mover closed.
	t.Cleanup(func() { c.set(&c.BatchRelease, 1); <-returned })

	waitFor(t, "the device counted as faulted, or ReadFile returning", func() bool {
		select {
		case <-returned:
			return true
		default:
			return m.DeviceFaults()[0] == 1
		}
	})
	select {
	case r := <-res:
		t.Fatalf("ReadFile returned (%d, %v) while %d entries were still pending: the job ended while the library may still write into its memory",
			r.n, r.err, c.get(&c.BatchPending))
	default:
	}
	if cn, pend := c.get(&c.BatchCancels), c.get(&c.BatchPending); cn != 1 || pend != 32 {
		t.Fatalf("%d cancels, %d entries pending; want 1, 32", cn, pend)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	m.Forget(fsys.FileID{Dev: uint64(st.Dev), Ino: st.Ino})
	if dr, live := c.get(&c.HandlesDeregistered), c.get(&c.HandlesLive); dr != 0 || live != 1 {
		t.Fatalf("with the entries pending and the file forgotten: %d handles deregistered, %d live; want 0, 1 (the job holds it)", dr, live)
	}
	if d, live := c.get(&c.BatchDestroys), c.get(&c.BatchLive); d != 0 || live != 1 {
		t.Fatalf("with the entries pending: %d contexts destroyed, %d live; want 0, 1", d, live)
	}
	if bs := e.d.batchStats(); bs.Stuck != 1 {
		t.Fatalf("batchStats.Stuck = %d, want 1", bs.Stuck)
	}
	if !strings.Contains(e.logs.String(), "did not come back") {
		t.Fatalf("no log line about the stuck batch:\n%s", e.logs)
	}

	c.set(&c.BatchRelease, 1)
	r := <-res
	if !errors.Is(r.err, errBatchTimeout) || !strings.Contains(r.err.Error(), "came back") || r.n != 0 {
		t.Fatalf("ReadFile = %d, %v; want 0 and the timeout, saying when the entries came back", r.n, r.err)
	}
	if !bytes.Equal(gather(rp, dst.mem), gather(p, src.mem)) {
		t.Fatal("the late entries' bytes are not in the job's memory when it ends")
	}
	if pend, d, dr := c.get(&c.BatchPending), c.get(&c.BatchDestroys), c.get(&c.HandlesDeregistered); pend != 0 || d != 1 || dr != 1 {
		t.Fatalf("after the job: %d entries pending, %d contexts destroyed, %d handles deregistered; want 0, 1, 1", pend, d, dr)
	}
	if bad := c.get(&c.BatchBadUses) + c.get(&c.BadHandleUses); bad != 0 {
		t.Fatalf("%d bad uses of batch contexts or handles", bad)
	}
	if n := m.DeviceFaults()[0]; n != 1 {
		t.Fatalf("DeviceFaults()[0] = %d after the job; want 1 (counted once)", n)
	}

	c.set(&c.BatchHold, 0)
	c.set(&c.BatchCancelIgnored, 0)
	if n, err := m.ReadFile(context.Background(), f, rp, nil); err != nil || n != rp.Bytes() {
		t.Fatalf("ReadFile after the stuck batch = %d, %v", n, err)
	}
	if su := c.get(&c.BatchSetups); su != 2 {
		t.Fatalf("%d contexts set up; want 2 (the abandoned one is not reused)", su)
	}
}

// scriptedBatchFake's batches report what its script says, a line per
// cuFileBatchIOGetStatus call: events by entry index (unknownEntry: a
// cookie the batch never had), complete with all the entry's bytes unless
// the event names another state. Past the script, calls report nothing
// (after waiting their timeout) until release is closed, then each an
// entry the script did not report back (complete, failed, canceled...),
// in order.
type scriptedBatchFake struct {
	*goFake
	script  [][]scriptedEvent
	release chan struct{}
}

// scriptedEvent is one event of a scriptedBatchFake's line.
type scriptedEvent struct {
	entry  int
	status batchStatus // 0: batchComplete
}

// unknownEntry is an entry index no batch of the tests has.
const unknownEntry = 999

func (g *scriptedBatchFake) hasBatch() bool                   { return true }
func (g *scriptedBatchFake) batchSetUp(int) (batchCtx, error) { return &scriptedBatch{g: g}, nil }

type scriptedBatch struct {
	g     *scriptedBatchFake
	ios   []batchIO
	back  []bool // by entry: reported back
	calls int
}

func (b *scriptedBatch) submit(ios []batchIO) error {
	b.ios, b.back, b.calls = slices.Clone(ios), make([]bool, len(ios)), 0
	return nil
}
func (b *scriptedBatch) cancel() error { return nil }
func (b *scriptedBatch) destroy()      {}

func (b *scriptedBatch) status(_ int, ev []batchEvent, timeout time.Duration) (int, error) {
	event := func(i int, st batchStatus) batchEvent {
		if st == 0 {
			st = batchComplete
		}
		if i >= len(b.ios) {
			return batchEvent{cookie: uintptr(i), status: st}
		}
		if st != batchWaiting && st != batchPending {
			b.back[i] = true
		}
		return batchEvent{cookie: b.ios[i].cookie, status: st, ret: b.ios[i].n}
	}
	if b.calls < len(b.g.script) {
		line := b.g.script[b.calls]
		b.calls++
		n := 0
		for _, se := range line[:min(len(line), len(ev))] {
			ev[n] = event(se.entry, se.status)
			n++
		}
		return n, nil
	}
	select {
	case <-b.g.release:
		if i := slices.Index(b.back, false); i >= 0 && len(ev) > 0 {
			ev[0] = event(i, batchComplete)
			return 1, nil
		}
		return 0, nil
	case <-time.After(timeout):
		return 0, nil
	}
}

// openScriptedBatchFake opens a driver over a scriptedBatchFake.
func openScriptedBatchFake(t *testing.T, script [][]scriptedEvent) (*scriptedBatchFake, *Driver) {
	t.Helper()
	g := &scriptedBatchFake{goFake: newGoFake(), script: script, release: make(chan struct{})}
	return g, openGoAPI(t, g)
}

// An event for an entry the batch does not have fails the job, and the
// batch is abandoned with the entries still out: the real completions
// that came in the same status call are counted first, or the job would
// wait for entries the library already gave back, held for good with its
// device counted as faulted.
func TestMoverCountsABatchsCompletionsAfterAnUnknownEvent(t *testing.T) {
	// The first status call reports the first two entries, an event for
	// a cookie the batch never had and the third entry; the second the
	// fourth.
	g, d := openScriptedBatchFake(t, [][]scriptedEvent{{{0, 0}, {1, 0}, {unknownEntry, 0}, {2, 0}}, {{3, 0}}})
	m := newMover(t, d, MoverConfig{Workers: 1, AllowCompat: true, IO: IOBatch})
	src := newHostDevice(t, 1, 1<<20, 0)
	p := sparsePlan(src, 4, 4096, 1)
	f := openFile(t, filepath.Join(t.TempDir(), "key"), os.O_RDWR)
	res := make(chan error, 1)
	go func() { _, err := m.WriteFile(context.Background(), f, p, nil); res <- err }()
	var jobErr error
	returned := false
	waitFor(t, "WriteFile returning, or its batch stuck", func() bool {
		select {
		case jobErr = <-res:
			returned = true
			return true
		default:
			return d.batchStats().Stuck > 0
		}
	})
	if !returned {
		t.Errorf("WriteFile held after every entry came back: batch stuck (device faults %v)", m.DeviceFaults())
		close(g.release)
		jobErr = <-res
	}
	if jobErr == nil || !strings.Contains(jobErr.Error(), "unknown entry 999") {
		t.Errorf("WriteFile = %v, want the unknown entry's error", jobErr)
	}
	if st := d.batchStats(); st.Abandoned != 1 || st.Stuck != 0 {
		t.Errorf("batchStats = %+v, want 1 abandoned, none stuck", st)
	}
	if faults := m.DeviceFaults(); len(faults) != 0 {
		t.Errorf("DeviceFaults = %v, want none", faults)
	}
}

// TestMoverHoldsAJobUntilEveryBatchEntryIsBack: an event that brings
// no outstanding entry back is not counted as one: an event in a state
// that is not final (waiting, pending: cuFile still has the entry), or,
// once the batch is abandoned, a second event for an entry already back
// or one for a cookie the batch never had. Counted, the job would end
// while cuFile may still move bytes into its memory; instead it is held
// as for entries that do not come back after the cancel (the batch
// stuck, the device counted as faulted) until the library reports every
// entry.
func TestMoverHoldsAJobUntilEveryBatchEntryIsBack(t *testing.T) {
	tests := []struct {
		name   string
		script [][]scriptedEvent
		want   string // in the job's error
	}{
		{"an entry reported pending", [][]scriptedEvent{{{0, 0}, {1, 0}, {2, 0}, {3, batchPending}}}, "CUFILE_PENDING"},
		{"an entry reported waiting", [][]scriptedEvent{{{0, 0}, {1, 0}, {2, batchWaiting}, {3, 0}}}, "CUFILE_WAITING"},
		{"entries reported again after an unknown event", [][]scriptedEvent{{{0, 0}, {1, 0}, {unknownEntry, 0}}, {{0, 0}, {1, 0}}}, "unknown entry 999"},
		{"unknown events after an unknown event", [][]scriptedEvent{{{0, 0}, {1, 0}, {unknownEntry, 0}}, {{unknownEntry, 0}, {unknownEntry + 1, 0}}}, "unknown entry 999"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g, d := openScriptedBatchFake(t, tt.script)
			m := newMover(t, d, MoverConfig{Workers: 1, AllowCompat: true, IO: IOBatch, BatchTimeout: 30 * time.Millisecond})
			src := newHostDevice(t, 1, 1<<20, 0)
			p := sparsePlan(src, 4, 4096, 1)
			f := openFile(t, filepath.Join(t.TempDir(), "key"), os.O_RDWR)
			res := make(chan error, 1)
			go func() { _, err := m.WriteFile(context.Background(), f, p, nil); res <- err }()
			waitFor(t, "WriteFile returning, or its batch stuck", func() bool {
				return len(res) > 0 || d.batchStats().Stuck > 0
			})
			select {
			case err := <-res:
				t.Fatalf("WriteFile returned (%v) while entries of its batch were still out", err)
			default:
			}
			close(g.release)
			if err := <-res; err == nil || !strings.Contains(err.Error(), tt.want) || !strings.Contains(err.Error(), "came back") {
				t.Fatalf("WriteFile = %v; want an error naming %q, saying when the entries came back", err, tt.want)
			}
			if faults := m.DeviceFaults(); faults[0] != 1 {
				t.Errorf("DeviceFaults = %v, want 1 on device 0", faults)
			}
		})
	}
}

func TestMoverWithoutBatchAPIGoesPerCall(t *testing.T) {
	e := openFakeBuilt(t, Config{}, nil, "-DFAKE_NO_BATCH")
	if e.d.Properties().BatchAPI {
		t.Fatal("Properties.BatchAPI true for a library without the batch symbols")
	}
	m := newMover(t, e.d, MoverConfig{Workers: 2, AllowCompat: true, IO: IOBatch})
	src, dst := newHostDevice(t, 1, 1<<20, 0), newHostDevice(t, 2, 1<<20, 0)
	fill(src.mem, 16)
	roundTrip(t, m, filepath.Join(t.TempDir(), "key"), sparsePlan(src, 16, 4096, 4), src, dst)
	if w := e.ctl.get(&e.ctl.Writes); w != 16 {
		t.Fatalf("%d cuFileWrite calls for 16 pages without the batch API; want 16", w)
	}
}

func TestMoverAutoBatchesOnlyWhereItPays(t *testing.T) {
	tests := []struct {
		name     string
		io       IOMode
		api      bool
		features uint32
		mode     Mode
		batch    batchState
		want     bool
	}{
		{"auto, direct, driver supports batches", IOAuto, true, featureBatchIO, ModeDirect, batchStateUnknown, true},
		{"auto, direct, driver does not", IOAuto, true, 0, ModeDirect, batchStateUnknown, false},
		{"auto, compat: as measured", IOAuto, true, featureBatchIO, ModeCompat, batchStateUnknown, autoBatchCompat},
		{"batch, compat", IOBatch, true, 0, ModeCompat, batchStateUnknown, true},
		{"batch, refused mount", IOBatch, true, featureBatchIO, ModeCompat, batchStateRefused, false},
		{"batch, no batch API", IOBatch, false, featureBatchIO, ModeDirect, batchStateUnknown, false},
		{"per-call, direct", IOPerCall, true, featureBatchIO, ModeDirect, batchStateUnknown, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := &Driver{props: Properties{BatchAPI: tt.api, FeatureFlags: tt.features}}
			m := &Mover{d: d, cfg: MoverConfig{IO: tt.io}}
			if got := m.useBatch(Capability{Mode: tt.mode, batch: tt.batch}.forFile(unix.O_RDWR | unix.O_DIRECT)); got != tt.want {
				t.Fatalf("useBatch = %v, want %v", got, tt.want)
			}
		})
	}
	// A file open without O_DIRECT meets a direct mount as compat.
	m := &Mover{d: &Driver{props: Properties{BatchAPI: true, FeatureFlags: featureBatchIO}}, cfg: MoverConfig{IO: IOAuto}}
	if got := m.useBatch(Capability{Mode: ModeDirect}.forFile(unix.O_RDWR)); got != autoBatchCompat {
		t.Errorf("useBatch for a buffered file on a direct mount = %v, want %v (compat's)", got, autoBatchCompat)
	}
}

func TestChunksSplitEvenlyAndNeverSpanDevices(t *testing.T) {
	mk := func(ordinals ...int) []piece {
		var p []piece
		for _, o := range ordinals {
			p = append(p, piece{ordinal: o})
		}
		return p
	}
	rep := func(o, n int) []int {
		s := make([]int, n)
		for i := range s {
			s[i] = o
		}
		return s
	}
	tests := []struct {
		name string
		pcs  []piece
		size int
		want []int // chunk lengths
	}{
		{"exact", mk(rep(0, 256)...), 128, []int{128, 128}},
		{"even split", mk(rep(0, 130)...), 128, []int{65, 65}},
		{"one short batch", mk(rep(0, 5)...), 128, []int{5}},
		{"device change", mk(append(rep(0, 3), rep(1, 4)...)...), 128, []int{3, 4}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got []int
			for _, c := range chunks(tt.pcs, tt.size) {
				got = append(got, len(c))
				for _, pc := range c {
					if pc.ordinal != c[0].ordinal {
						t.Fatal("a chunk spans two devices")
					}
				}
			}
			if len(got) != len(tt.want) {
				t.Fatalf("chunks %v, want %v", got, tt.want)
			}
			for i := range got {
				if got[i] != tt.want[i] {
					t.Fatalf("chunks %v, want %v", got, tt.want)
				}
			}
		})
	}
}

func TestNewMoverRejectsUnknownIOMode(t *testing.T) {
	e := openFake(t, Config{}, nil)
	if _, err := e.d.NewMover(MoverConfig{IO: IOMode(9)}); err == nil || !strings.Contains(err.Error(), "IOMode(9)") {
		t.Fatalf("NewMover with IO 9 = %v; want an error naming it", err)
	}
}

func TestBatchEntriesInFlightStayWithinTheDriverBudget(t *testing.T) {
	tests := []struct {
		name      string
		entries   int
		wantBatch int64 // largest batch: the budget caps the batch size
	}{
		{"budget below the batch size", 24, 24},
		{"budget of two batches", 64, 32},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := openFake(t, Config{BatchEntries: tt.entries}, nil)
			m := newMover(t, e.d, MoverConfig{Workers: 6, AllowCompat: true, IO: IOBatch, BatchSize: 32})
			src := newHostDevice(t, 1, 4<<20, 0)
			fill(src.mem, 17)
			dir := t.TempDir()
			errs := make(chan error, 6)
			for j := range 6 {
				go func() {
					f := openFile(t, filepath.Join(dir, string(rune('a'+j))), os.O_RDWR)
					var err error
					for i := range 4 {
						if _, err = m.WriteFile(context.Background(), f, sparsePlan(src, 192, 4096, uint64(j*4+i)), nil); err != nil {
							break
						}
					}
					errs <- err
				}()
			}
			for range 6 {
				if err := <-errs; err != nil {
					t.Fatal(err)
				}
			}
			c := e.ctl
			if mx := c.get(&c.BatchInflightMax); mx > int64(tt.entries) || mx == 0 {
				t.Fatalf("%d entries in flight at most; want between 1 and the budget %d", mx, tt.entries)
			}
			if mx := c.get(&c.BatchMaxEntries); mx != tt.wantBatch {
				t.Fatalf("largest batch %d entries; want %d", mx, tt.wantBatch)
			}
		})
	}
}

func TestEntryBudgetGrantsInOrderAndHonorsContext(t *testing.T) {
	b := newEntryBudget(10)
	ctx := context.Background()
	if err := b.acquire(ctx, 8); err != nil {
		t.Fatal(err)
	}
	if err := b.acquire(ctx, 11); err == nil {
		t.Fatal("acquire of more than the budget succeeded")
	}
	got := make(chan int, 2)
	go func() { b.acquire(ctx, 6); got <- 6 }()
	waitFor(t, "the first waiter queued", func() bool { b.mu.Lock(); defer b.mu.Unlock(); return b.waiters.Len() == 1 })
	go func() { b.acquire(ctx, 1); got <- 1 }()
	waitFor(t, "the second waiter queued", func() bool { b.mu.Lock(); defer b.mu.Unlock(); return b.waiters.Len() == 2 })
	// 2 entries are free: enough for the second waiter, but the first
	// came first, and a newcomer does not jump the queue either.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := b.acquire(cctx, 1); !errors.Is(err, context.Canceled) {
		t.Fatalf("acquire with a canceled context behind waiters = %v, want context.Canceled", err)
	}
	b.mu.Lock()
	free, waiting := b.free, b.waiters.Len()
	b.mu.Unlock()
	if free != 2 || waiting != 2 {
		t.Fatalf("with 2 free and waiters for 6 then 1: %d free, %d waiting; want 2, 2 (first come, first served)", free, waiting)
	}
	b.release(8)
	if a, c := <-got, <-got; a+c != 7 {
		t.Fatalf("granted %d and %d; want 6 and 1", a, c)
	}
	b.release(7)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.free != 10 || b.waiters.Len() != 0 {
		t.Fatalf("after all releases: %d free, %d waiting; want 10, 0", b.free, b.waiters.Len())
	}
}

func TestMoverBatchKeepsOneContextPerWorkerAndDevice(t *testing.T) {
	var mu sync.Mutex
	var binds []int
	bind := func(ordinal int) error {
		mu.Lock()
		defer mu.Unlock()
		binds = append(binds, ordinal)
		return nil
	}
	e := openFake(t, Config{BindDevice: bind}, nil)
	m, err := e.d.NewMover(MoverConfig{Workers: 1, AllowCompat: true, IO: IOBatch})
	if err != nil {
		t.Fatal(err)
	}
	a, b := newHostDevice(t, 1, 1<<20, 0), newHostDevice(t, 2, 1<<20, 1)
	fill(a.mem, 18)
	fill(b.mem, 19)
	// A plan over two devices: 16 pages from each, in file order.
	pa, pb := sparsePlan(a, 16, 4096, 1), sparsePlan(b, 16, 4096, 2)
	p := &transfer.Plan{Extents: pa.Extents}
	for _, x := range pb.Extents {
		x.FileOff += 16 * 4096
		p.Extents = append(p.Extents, x)
	}
	path := filepath.Join(t.TempDir(), "key")
	f := openFile(t, path, os.O_RDWR)
	for range 3 {
		if n, err := m.WriteFile(context.Background(), f, p, nil); err != nil || n != p.Bytes() {
			t.Fatalf("WriteFile over two devices = %d, %v", n, err)
		}
	}
	c := e.ctl
	if su, sub := c.get(&c.BatchSetups), c.get(&c.BatchSubmits); su != 2 || sub != 6 {
		t.Fatalf("%d contexts set up for 6 batches on 2 devices by one worker; want 2 (one per device, reused)", su)
	}
	mu.Lock()
	before := len(binds)
	mu.Unlock()
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if live, destroyed := c.get(&c.BatchLive), c.get(&c.BatchDestroys); live != 0 || destroyed != 2 {
		t.Fatalf("after Close: %d contexts live, %d destroyed; want 0, 2", live, destroyed)
	}
	file, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	want := append(gather(pa, a.mem), gather(pb, b.mem)...)
	if !bytes.Equal(file, want) {
		t.Fatal("file bytes differ from the two devices' pages")
	}
	mu.Lock()
	defer mu.Unlock()
	// The worker's last task ran on device 1: to destroy the context of
	// device 0 it binds device 0 again.
	if closing := binds[before:]; !slices.Contains(closing, 0) {
		t.Fatalf("binds while closing %v (all %v): the worker must bind device 0 to destroy its context there", closing, binds)
	}
}
