package engine

import (
	"context"
	"errors"
	"io/fs"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/abi"
)

// Demotion to the object mount ahead of need (docs/object.md): an
// upload to the bucket takes a request timeout's worth of time where a
// copy to a disk takes milliseconds, so a store whose room is made by
// evicting files to the bucket must not wait for their uploads. While a
// file mount is above its low watermark, the demoter asks the policy
// for the victims an eviction there would take next and copies those
// bound for the object mount to the bucket in the background, the
// coldest first. An eviction then drops at once each victim whose key
// the bucket holds (the removal feed records it moved there) and leaves
// those it does not hold for the demoter; only where the victims already
// in the bucket do not make the room it needs does it wait for the
// uploads of the others, bounded by its caller's context, and not while
// the bucket fails (the last upload failed, none succeeded since: the
// store fails for room at once). A file is never dropped for the object
// mount before its upload succeeded, unless the bucket refused it for
// room and the policy said MOVE_DELETE_IF_FULL.
//
// A pass asks the policy only where its answer may have changed since
// the last pass that asked: the policy was told something (a store, a
// hit, a pin, a removal, a move, a mount description: switchPolicy.
// changes), the bucket lost an object behind the engine's calls, that
// pass left something to retry (a failed call or upload), an eviction
// woke the demoter, or demoteRecheck passed (for a policy whose victims
// change with time or its own tick alone). An idle daemon above its low
// watermark then makes no policy call at each tick, where it made one
// per mount.

// Tuning of the demoter.
const (
	// demoteUploads is the most uploads the demoter runs at once (the
	// object mount bounds the requests of all of them together).
	demoteUploads = 4
	// demoteBackoff and maxDemoteBackoff bound the pause after an upload
	// of the demoter's failed: the bucket is not asked again meanwhile.
	demoteBackoff, maxDemoteBackoff = time.Second, 30 * time.Second
	// demoteRecheck is the longest a pass goes without asking the
	// policy while a file mount is above its low watermark, however
	// little changed.
	demoteRecheck = 10 * time.Second
)

// objectDemoter copies files to the object mount ahead of their
// demotion, and joins each upload of a victim an eviction waits for
// with the demoter's own of the same file.
type objectDemoter struct {
	t     *tiering
	every time.Duration // between passes, besides the kicks
	kick  chan struct{} // an eviction left a victim that the bucket lacks
	stop  chan struct{}
	done  chan struct{}

	mu       sync.Mutex
	inflight map[uint64]*objectUpload // by entry id
	// minPause and maxPause bound pause (demoteBackoff and
	// maxDemoteBackoff; a test shortens them).
	minPause, maxPause time.Duration
	// pause is how long the demoter waits after a failed upload before
	// its next pass (0: none failed since the last success); full says
	// the last failure was the bucket's refusal for room (ENOSPC).
	pause time.Duration
	full  bool
	// recheck is demoteRecheck (a test lengthens it).
	recheck time.Duration

	// uploaded and uploadedBytes count the files the demoter copied and
	// their bytes; failed, its uploads that failed.
	uploaded, uploadedBytes, failed atomic.Uint64

	// told is the policy's change count (switchPolicy.changes; nil:
	// every pass asks the policy).
	told func() uint64
	// last is what the last pass that asked the policy started from,
	// asked when, and clean whether it left nothing to retry: only run's
	// goroutine uses them. skipped counts the passes that did not ask.
	last    demoteState
	asked   time.Time
	clean   bool
	skipped atomic.Uint64
}

// demoteState is what the policy's victims for the demoter depend on,
// besides time: what the policy was told, and the objects the bucket
// lost.
type demoteState struct{ told, lost uint64 }

// objectUpload is an upload of an entry's file under way: done is
// closed once err is set.
type objectUpload struct {
	done chan struct{}
	err  error
}

// newObjectDemoter returns the demoter of t, which runs a pass every
// interval until stopped.
func newObjectDemoter(t *tiering, every time.Duration) *objectDemoter {
	d := &objectDemoter{t: t, every: every, kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{}), inflight: map[uint64]*objectUpload{},
		minPause: demoteBackoff, maxPause: maxDemoteBackoff, recheck: demoteRecheck}
	if sp, ok := t.pol.(*switchPolicy); ok {
		d.told = sp.changes
	}
	return d
}

// wake asks for a pass soon; it never blocks.
func (d *objectDemoter) wake() {
	select {
	case d.kick <- struct{}{}:
	default:
	}
}

// close stops the demoter and waits for its uploads to end (cancelled).
func (d *objectDemoter) close() {
	close(d.stop)
	<-d.done
}

// run runs passes until close.
func (d *objectDemoter) run() {
	defer close(d.done)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-d.stop
		cancel()
	}()
	tk := time.NewTicker(d.every)
	defer tk.Stop()
	for {
		woken := false
		select {
		case <-d.stop:
			return
		case <-tk.C:
		case <-d.kick:
			woken = true
		}
		d.mu.Lock()
		pause := d.pause
		d.mu.Unlock()
		if pause > 0 {
			select {
			case <-d.stop:
				return
			case <-time.After(pause):
			}
		}
		d.pass(ctx, woken)
	}
}

// pass uploads, on each file mount above its low watermark, the files
// bound for the object mount among the victims the next eviction there
// would take (from the high watermark, or the usage above it, down to
// the low one) and a quarter of that more, where the bucket lacks their
// keys; it returns once they are uploaded or failed. Files stored since
// are warmer than those: the next eviction finds its victims uploaded
// where the uploads kept up with the stores from the low watermark to
// the high one. Unless woken (an eviction left a victim the bucket
// lacks), it asks the policy nothing where nothing its answer depends on
// changed since the last pass that asked (asks).
func (d *objectDemoter) pass(ctx context.Context, woken bool) {
	t := d.t
	if !t.demotes() {
		return
	}
	usages := t.space.Usages()[:t.kvMounts]
	var above []int
	for i, u := range usages {
		if t.mounts[i].cluster == nil && u.Used > u.Low {
			above = append(above, i) // a cluster mount's victims are the cluster's; below low, no eviction is near
		}
	}
	if len(above) == 0 {
		return
	}
	if t.hits != nil {
		t.hits.flush() // rank with every hit reported so far
	}
	if !d.asks(woken) {
		d.skipped.Add(1)
		return
	}
	var wg sync.WaitGroup
	var dirty atomic.Bool
	defer func() { d.clean = !dirty.Load() }()
	slots := make(chan struct{}, demoteUploads)
	for _, i := range above {
		u := usages[i]
		goal := max(u.Used, u.High) - u.Low + (u.High-u.Low)/4
		victims, err := t.evictions(ctx, abi.EvictRequest{Bytes: uint64(goal), Time: uint64(t.now().UnixNano()), Mount: uint32(i)})
		if err != nil {
			dirty.Store(true)
			t.log.Debug("engine: policy victims for the object mount's uploads", "mount", t.mounts[i].root, "err", err)
			continue
		}
		for _, v := range victims {
			if goal <= 0 {
				break
			}
			pe, ok := t.ix.Files().PolicyEntry(v.Entry)
			if !ok {
				continue
			}
			goal -= int64(pe.Size)
			if !t.toObjects(int(v.Target.Mount)) {
				continue
			}
			path, fp, keys, ok := t.ix.Files().FileOf(v.Entry)
			if !ok || len(keys) != 1 || t.objs.holds(fp, []byte(keys[0])) {
				continue
			}
			select {
			case slots <- struct{}{}:
			case <-ctx.Done():
				wg.Wait()
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { <-slots }()
				if d.upload(ctx, v.Entry, fp, keys, path) != nil {
					dirty.Store(true)
				}
			}()
		}
	}
	wg.Wait()
}

// asks reports whether a pass asks the policy for victims, and if so
// notes what it starts from: where woken, where the demoter cannot tell
// what the policy was told, where the last pass that asked left
// something to retry or was recheck ago, and where the policy was told
// something or the bucket lost an object since.
func (d *objectDemoter) asks(woken bool) bool {
	if d.told == nil {
		return true
	}
	d.mu.Lock()
	recheck := d.recheck
	d.mu.Unlock()
	now := demoteState{told: d.told(), lost: d.t.objs.lost.Load()}
	if !woken && d.clean && now == d.last && time.Since(d.asked) < recheck {
		return false
	}
	d.last, d.asked = now, time.Now()
	return true
}

// failing reports whether the last upload to the object mount failed
// (none succeeded since), and whether for room: an eviction does not
// wait on a bucket that fails (demoteToObjects).
func (d *objectDemoter) failing() (failing, full bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.pause > 0, d.full
}

// upload copies the file at path, entry id's, of keys of namespace fp,
// to the object mount (objectTier.copy), or waits for the upload of it
// under way; ctx bounds the wait and an upload it starts. The demoter
// pauses after a failure (the bucket refused or did not answer), not
// after one cancelled.
func (d *objectDemoter) upload(ctx context.Context, id, fp uint64, keys []string, path string) error {
	d.mu.Lock()
	if up, ok := d.inflight[id]; ok {
		d.mu.Unlock()
		select {
		case <-up.done:
			return up.err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	up := &objectUpload{done: make(chan struct{})}
	d.inflight[id] = up
	d.mu.Unlock()

	var size uint64
	if pe, ok := d.t.ix.Files().PolicyEntry(id); ok {
		size = pe.Size
	}
	sent, err := d.t.objs.copy(ctx, fp, keys, path)
	up.err = err
	d.mu.Lock()
	delete(d.inflight, id)
	switch {
	case up.err == nil:
		if sent {
			d.uploaded.Add(1)
			d.uploadedBytes.Add(size)
		}
		d.pause, d.full = 0, false
	case errors.Is(up.err, fs.ErrNotExist):
		// The file went meanwhile (evicted, deleted): no fault of the
		// bucket's.
	case ctx.Err() == nil:
		d.failed.Add(1)
		d.pause = min(max(2*d.pause, d.minPause), d.maxPause)
		d.full = errors.Is(up.err, syscall.ENOSPC)
		if !d.full {
			d.t.log.Debug("engine: upload to the object mount failed", "path", path, "err", up.err)
		}
	}
	d.mu.Unlock()
	close(up.done)
	return up.err
}
