package engine

import (
	"cmp"
	"context"
	"slices"
	"sync"

	"github.com/kvhost/kvhost/fsys"
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

// warmer is the goroutine that offers files ahead of jobs.
type warmer struct {
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
// files ahead of jobs, with the files indexed at start on such mounts,
// the most recently used first.
func (e *Engine) startWarmer() {
	want := false
	for _, m := range e.mounts {
		want = want || len(m.warmers()) > 0
	}
	if !want {
		return
	}
	type found struct {
		warmFile
		last int64
	}
	var start []found
	e.ix.Each(func(en *entry) {
		if m := e.mounts[en.Mount]; m.memory {
			start = append(start, found{warmFile{en.Mount, en.Path, en.Ident}, en.Last})
		}
	})
	slices.SortFunc(start, func(a, b found) int { return cmp.Compare(b.last, a.last) })
	files := make([]warmFile, len(start))
	for i, f := range start {
		files[i] = f.warmFile
	}
	w := &warmer{found: make(chan warmFile, warmQueue), stop: make(chan struct{}), started: make(chan struct{}), done: make(chan struct{})}
	e.warm = w
	go e.runWarmer(w, files)
}

// WaitWarmed waits until the files indexed at Open on memory mounts have
// been offered to the movers that take files ahead of jobs (as many as
// they take), the engine closed, or ctx ended; at once where there is no
// such mover. The
// movers' registrations of those files are their own background work,
// not waited for.
func (e *Engine) WaitWarmed(ctx context.Context) error {
	if e.warm == nil {
		return nil
	}
	select {
	case <-e.warm.started: // first, so that an ended ctx never hides it
		return nil
	default:
	}
	select {
	case <-e.warm.started:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// stopWarmer stops the warmer and waits for the offer it is making.
func (e *Engine) stopWarmer() {
	if e.warm == nil {
		return
	}
	close(e.warm.stop)
	<-e.warm.done
}

// warmDiscovered offers en, a file a lookup discovered, to the movers of
// its mount that take files ahead of jobs, off the lookup's path.
func (e *Engine) warmDiscovered(en *entry) {
	w := e.warm
	if w == nil || len(e.mounts[en.Mount].warmers()) == 0 {
		return
	}
	select {
	case w.found <- warmFile{en.Mount, en.Path, en.Ident}:
	default: // its first load offers it
	}
}

// runWarmer offers the files found at start until every mover that takes
// files reports that it takes no more, then each discovered file.
func (e *Engine) runWarmer(w *warmer, start []warmFile) {
	defer close(w.done)
	started := sync.OnceFunc(func() { close(w.started) })
	defer started() // stopped before the start files were all offered
	full := map[transfer.Warmer]bool{}
	all := map[transfer.Warmer]bool{}
	for _, m := range e.mounts {
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
		e.offerWarm(f, full)
	}
	started()
	for {
		select {
		case <-w.stop:
			return
		case f := <-w.found:
			e.offerWarm(f, nil)
		}
	}
}

// offerWarm opens f, if it is still the file indexed, and offers it to
// the warmers of its mount not in full; a warmer that reports it takes no
// more is added to full (nil: not recorded).
func (e *Engine) offerWarm(f warmFile, full map[transfer.Warmer]bool) {
	var ws []transfer.Warmer
	for _, w := range e.mounts[f.mount].warmers() {
		if !full[w] {
			ws = append(ws, w)
		}
	}
	if len(ws) == 0 {
		return
	}
	fh, id, err := e.openRegular(e.mounts[f.mount], f.path)
	if err != nil {
		return // removed or replaced since: nothing to offer
	}
	defer fh.Close()
	if !id.Same(f.ident) {
		return
	}
	for _, w := range ws {
		if !w.Warm(fh) && full != nil {
			full[w] = true
		}
	}
}
