package engine

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/internal/engine/index"
)

// Files found at start verified ahead of their loads (docs/engine.md,
// "The load path"; RATIONALE: "Why does a load from a memory mount not sum
// again what was verified?").
//
// A load from a memory mount moves without summing them the layers this
// engine wrote or verified while the file's ctime is unchanged
// (checked.go). A restarted engine wrote none of the files it finds, so
// each one's first loads sum every byte they move, on the CPU, beside the
// copies. The verifier, a goroutine started at Open where a memory mount
// found files whose loads it would sum once, reads those files, the most
// recently used first, sums each key privately (recheck) and, where every
// key matches its header and the file's ctime after the reads is what it
// was at the open, records the file as verified at that ctime: its later
// loads take it as they take a file this engine wrote. It verifies one
// file at a time, and only while no file is in flight, so that it takes
// no CPU or memory bandwidth from a burst of jobs (whose loads verify
// what they read themselves). A file that fails its sums, or changed
// meanwhile, is left as it was: its first load verifies it and judges it
// (ErrCorrupt), as before.

// verifyQuiet is how long the verifier waits before looking again while
// files are in flight.
const verifyQuiet = 5 * time.Millisecond

// verifier is the goroutine that verifies the files found at start. Its
// methods do nothing on a nil verifier: where no mount has such files.
type verifier struct {
	hd    *headerReader
	ix    *index.Index
	busy  func() bool // whether a file is in flight (fileSlots.busy)
	log   *slog.Logger
	files []*entry // found at start, the most recently used first

	verified atomic.Uint64 // files recorded as verified (Stats.FilesVerifiedAhead)
	ctx      context.Context
	stop     context.CancelFunc // ends ctx: close
	done     chan struct{}      // closed once every file was tried, or at stop
}

// verifiesAhead reports whether m's loads would sum a found file's bytes
// once and then take them as verified: the files the verifier reads.
func (m *mount) verifiesAhead() bool {
	return m.memory && m.raw == nil && m.checksums && !m.checkEvery
}

// startVerifier starts the verifier on the files ix holds on mounts that
// verify ahead, the most recently used first; nil where there are none.
func startVerifier(mounts []*mount, ix *index.Index, hd *headerReader, busy func() bool, log *slog.Logger) *verifier {
	files := foundAtStart(mounts, ix, (*mount).verifiesAhead)
	if len(files) == 0 {
		return nil
	}
	v := &verifier{hd: hd, ix: ix, busy: busy, log: log, files: files, done: make(chan struct{})}
	v.ctx, v.stop = context.WithCancel(context.Background())
	go v.run()
	return v
}

// run verifies the files in order, each once no file is in flight.
func (v *verifier) run() {
	defer close(v.done)
	start := time.Now()
	var bytes int64
	for i, en := range v.files {
		if !v.quiet() {
			return
		}
		if v.file(en) {
			v.verified.Add(1)
			bytes += en.Size
		}
		v.files[i] = nil // not held past its turn
	}
	v.log.Info("engine: files found at start verified ahead of their loads", "files", v.verified.Load(),
		"of", len(v.files), "bytes", bytes, "took", time.Since(start).Round(time.Millisecond))
}

// quiet waits until no file is in flight; false once the verifier stops.
func (v *verifier) quiet() bool {
	for v.busy() && v.ctx.Err() == nil {
		t := time.NewTimer(verifyQuiet)
		select {
		case <-v.ctx.Done():
		case <-t.C:
		}
		t.Stop()
	}
	return v.ctx.Err() == nil
}

// file verifies en's file and records it as verified; false where it was
// not (gone, replaced, changed while read, a key that fails its sum, or
// verified at its present ctime already, by a load).
func (v *verifier) file(en *entry) bool {
	if v.ix.Files().Gone(en) {
		return false
	}
	m := v.hd.mounts[en.Mount]
	f, h, err := v.hd.openSame(en, loadFlag(m))
	if err != nil {
		return false // its load finds out what is wrong
	}
	defer f.Close()
	id, err := fileIdentity(f)
	keys := allKeys(h)
	if err != nil || id.Ctime == 0 || checkedBefore(m, en, h, id, keys, LayerRange{}) {
		return false
	}
	sums, err := recheck(v.ctx, f, h, nil)
	if err != nil {
		return false
	}
	for k, s := range sums {
		if s != h.Keys[k].Sum {
			v.log.Warn("engine: a file found at start fails its checksum; its first load verifies it", "path", en.Path, "key", k)
			return false
		}
	}
	if !unchangedSince(f, id) {
		return false
	}
	markChecked(m, en, h, id.Ctime, keys, LayerRange{})
	return true
}

// count is the files verified so far (0 on a nil verifier).
func (v *verifier) count() uint64 {
	if v == nil {
		return 0
	}
	return v.verified.Load()
}

// close stops the verifier and waits for the file it is reading.
func (v *verifier) close() {
	if v == nil {
		return
	}
	v.stop()
	<-v.done
}
