package engine

import (
	"cmp"
	"context"
	"slices"
	"sync"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/transfer"
)

// Files offered to the movers ahead of any job (transfer.Warmer;
// docs/gpu.md, "Registered files").
//
// The GPU path registers a file on a memory file system with CUDA in the
// background after a job moved it, so that the file's later jobs copy
// straight between the device and its pages. Files the engine indexed
// without a job would wait for a first load through the pinned buffers:
// the files on a memory mount when the engine opens (a restart), and the
// files of another process or node that a lookup discovers. The warmer,
// a goroutine started at Open where a memory mount has a mover that
// implements transfer.Warmer, offers those: at start the files found, the
// most recently used first, until every such mover reports it takes no
// more (its bound: Warm never makes room by dropping another file); then
// each file a lookup discovers, as it is found. Opening a file and
// handing the registrar a descriptor of it is all it does: the
// registration itself is the movers' background work, within their
// bounds, and never on a job's path.

// warmQueue bounds the discovered files waiting for the warmer; one that
// finds the queue full is not offered (its first load offers it).
const warmQueue = 256

// warmFile is a file to offer: its mount, path and identity when it was
// indexed (a file replaced since is not offered).
type warmFile struct {
	mount int
	path  string
	ident fsys.Identity
}

// warmer is the goroutine that offers files ahead of jobs. Its methods
// do nothing on a nil warmer: where no mover takes files ahead of jobs.
type warmer struct {
	mounts []*mount // fixed at Open
	// open opens a file of a mount to offer, with its identity
	// (openRegular).
	open func(m *mount, path string) (fsys.File, fsys.Identity, error)

	found   chan warmFile // discovered by lookups
	stop    chan struct{}
	started chan struct{} // closed once the files found at start are offered
	done    chan struct{}
}

// warmers returns the distinct movers of m that take files ahead of
// jobs; none where m is not a memory file system.
func (m *mount) warmers() []transfer.Warmer {
	if !m.memory {
		return nil
	}
	var out []transfer.Warmer
	for _, mv := range m.movers {
		if w, ok := mv.(transfer.Warmer); ok && !slices.Contains(out, w) {
			out = append(out, w)
		}
	}
	return out
}

// startWarmer starts the warmer if a memory mount has a mover that takes
// files ahead of jobs, with the files indexed at start (ix) on such
// mounts, the most recently used first; nil where none does.
func startWarmer(mounts []*mount, ix *index.Index, open func(m *mount, path string) (fsys.File, fsys.Identity, error)) *warmer {
	want := false
	for _, m := range mounts {
		want = want || len(m.warmers()) > 0
	}
	if !want {
		return nil
	}
	var files []warmFile
	for _, en := range foundAtStart(mounts, ix, func(m *mount) bool { return m.memory }) {
		files = append(files, warmFile{en.Mount, en.Path, en.Ident})
	}
	w := &warmer{mounts: mounts, open: open, found: make(chan warmFile, warmQueue), stop: make(chan struct{}), started: make(chan struct{}), done: make(chan struct{})}
	go w.run(files)
	return w
}

// foundAtStart returns the entries ix holds on the mounts keep takes,
// the most recently used first: the files the warmer and the verifier
// work through after Open.
func foundAtStart(mounts []*mount, ix *index.Index, keep func(*mount) bool) []*entry {
	type found struct {
		en   *entry
		last int64 // read under the index's lock, where hits write it
	}
	var start []found
	ix.Files().Each(func(en *entry) {
		if keep(mounts[en.Mount]) {
			start = append(start, found{en, en.Last})
		}
	})
	slices.SortStableFunc(start, func(a, b found) int { return cmp.Compare(b.last, a.last) })
	out := make([]*entry, len(start))
	for i, f := range start {
		out[i] = f.en
	}
	return out
}

// WaitWarmed waits until the files indexed at Open on memory mounts have
// been offered to the movers that take files ahead of jobs (as many as
// they take), the engine closed, or ctx ended; at once where there is no
// such mover. The
// movers' registrations of those files are their own background work,
// not waited for.
func (e *Engine) WaitWarmed(ctx context.Context) error { return e.warm.wait(ctx) }

// wait is WaitWarmed.
func (w *warmer) wait(ctx context.Context) error {
	if w == nil {
		return nil
	}
	select {
	case <-w.started: // first, so that an ended ctx never hides it
		return nil
	default:
	}
	select {
	case <-w.started:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// close stops the warmer and waits for the offer it is making.
func (w *warmer) close() {
	if w == nil {
		return
	}
	close(w.stop)
	<-w.done
}

// discovered offers en, a file a lookup discovered, to the movers of
// its mount that take files ahead of jobs, off the lookup's path.
func (w *warmer) discovered(en *entry) {
	if w == nil || len(w.mounts[en.Mount].warmers()) == 0 {
		return
	}
	select {
	case w.found <- warmFile{en.Mount, en.Path, en.Ident}:
	default: // its first load offers it
	}
}

// run offers the files found at start until every mover that takes
// files reports that it takes no more, then each discovered file.
func (w *warmer) run(start []warmFile) {
	defer close(w.done)
	started := sync.OnceFunc(func() { close(w.started) })
	defer started() // stopped before the start files were all offered
	full := map[transfer.Warmer]bool{}
	all := map[transfer.Warmer]bool{}
	for _, m := range w.mounts {
		for _, mv := range m.warmers() {
			all[mv] = true
		}
	}
	for _, f := range start {
		if len(full) == len(all) {
			break
		}
		select {
		case <-w.stop:
			return
		default:
		}
		w.offer(f, full)
	}
	started()
	for {
		select {
		case <-w.stop:
			return
		case f := <-w.found:
			w.offer(f, nil)
		}
	}
}

// offer opens f, if it is still the file indexed, and offers it to
// the warmers of its mount not in full; a warmer that reports it takes no
// more is added to full (nil: not recorded).
func (w *warmer) offer(f warmFile, full map[transfer.Warmer]bool) {
	var ws []transfer.Warmer
	for _, mv := range w.mounts[f.mount].warmers() {
		if !full[mv] {
			ws = append(ws, mv)
		}
	}
	if len(ws) == 0 {
		return
	}
	fh, id, err := w.open(w.mounts[f.mount], f.path)
	if err != nil {
		return // removed or replaced since: nothing to offer
	}
	defer fh.Close()
	if !id.Same(f.ident) {
		return
	}
	for _, mv := range ws {
		if !mv.Warm(fh) && full != nil {
			full[mv] = true
		}
	}
}
