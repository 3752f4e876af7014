package index

import "github.com/kvhost/kvhost/abi"

// The restart hold's pins (the engine's hold.go), kept by Pins.

// holdLocked pins en for the restart hold: each file found at start,
// and the copy of a held file that a demotion moved (Index.Moved),
// which keeps the hold's pin.
func (p *Pins) holdLocked(en *Entry) {
	en.held = true
	en.pins++
	p.heldN++
	p.heldOrder[en.Mount] = append(p.heldOrder[en.Mount], en)
}

// unholdLocked ends the restart hold's pin of en, which it holds; en
// stays in heldOrder until the hold ends.
func (p *Pins) unholdLocked(en *Entry) {
	en.held = false
	en.pins--
	p.heldN--
}

// heldChunk is the most held entries a visit of them (inHeldChunks,
// inChunks) handles in one hold of the index's write lock. Right after a
// restart most of a mount's files are held, hundreds of thousands on a
// large memory mount, and every request that pins, hits or publishes
// waits while the lock is held for writing: a chunk bounds that wait to
// 1024 entries' work (RATIONALE.md, "Why does the restart hold visit its
// files in chunks?").
const heldChunk = 1024

// inHeldChunks calls fn for each entry of mount mnt's heldOrder, or of
// every mount's where mnt is negative, with the index's lock held for
// writing, released after each heldChunk of them. An entry is found as
// it is then: fn checks that it is still held (one unindexed or
// released meanwhile stays listed) and what else it relies on. Entries
// appended to a list meanwhile are visited too.
func (p *Pins) inHeldChunks(mnt int, fn func(*Entry)) {
	p.mu.RLock()
	var mounts []int
	for m := range p.heldOrder {
		if mnt < 0 || m == mnt {
			mounts = append(mounts, m)
		}
	}
	p.mu.RUnlock()
	for _, m := range mounts {
		for at := 0; ; at += heldChunk {
			p.mu.Lock()
			list := p.heldOrder[m]
			if at >= len(list) {
				p.mu.Unlock()
				break
			}
			for _, en := range list[at:min(at+heldChunk, len(list))] {
				fn(en)
			}
			p.mu.Unlock()
		}
	}
}

// inChunks calls fn for each of ens in order, with the index's lock held
// for writing, released after each heldChunk of them.
func (p *Pins) inChunks(ens []*Entry, fn func(*Entry)) {
	for len(ens) > 0 {
		part := ens[:min(len(ens), heldChunk)]
		ens = ens[len(part):]
		p.mu.Lock()
		for _, en := range part {
			fn(en)
		}
		p.mu.Unlock()
	}
}

// HoldAll pins every indexed entry for the restart hold (holdLocked) and
// returns the policy's pin records at now.
func (p *Pins) HoldAll(now int64) []abi.AccessRecord {
	p.mu.Lock()
	defer p.mu.Unlock()
	recs := make([]abi.AccessRecord, 0, len(p.files.entries))
	for _, en := range p.files.entries {
		p.holdLocked(en)
		recs = append(recs, en.Access(abi.AccessPin, now))
	}
	return recs
}

// EndHold ends the restart hold's pin of every entry it holds, in chunks
// (inHeldChunks), and forgets its lists. It returns how many it let go
// and, with tell, the policy's unpin records at now.
func (p *Pins) EndHold(tell bool, now int64) (n int, recs []abi.AccessRecord) {
	p.inHeldChunks(-1, func(en *Entry) {
		if !en.held { // unindexed meanwhile (it let the hold go then), or listed twice
			return
		}
		p.unholdLocked(en)
		n++
		if tell {
			recs = append(recs, en.Access(abi.AccessUnpin, now))
		}
	})
	p.mu.Lock()
	clear(p.heldOrder)
	p.mu.Unlock()
	return n, recs
}

// HeldFound is the number of indexed entries the restart hold pins.
func (p *Pins) HeldFound() int {
	p.mu.RLock()
	defer p.mu.RUnlock()
	return p.heldN
}

// LiftHeld lifts, in the policy's view, the restart hold's pin of mount
// mnt's held entries that nothing else pins (Entry.lifted), in chunks,
// and returns them with the policy's unpin records at now.
func (p *Pins) LiftHeld(mnt int, now int64) (lifted []*Entry, recs []abi.AccessRecord) {
	p.inHeldChunks(mnt, func(en *Entry) {
		if en.held && !en.lifted && en.pins == 1 {
			en.lifted = true
			lifted = append(lifted, en)
			recs = append(recs, en.Access(abi.AccessUnpin, now))
		}
	})
	return lifted, recs
}

// Unlift ends LiftHeld's lift of lifted and returns the policy's pin
// records at now of those still indexed and held (not moved: a move's
// copy was pinned by the move).
func (p *Pins) Unlift(lifted []*Entry, now int64) []abi.AccessRecord {
	var recs []abi.AccessRecord
	p.inChunks(lifted, func(en *Entry) {
		en.lifted = false
		if !en.gone && en.held {
			recs = append(recs, en.Access(abi.AccessPin, now))
		}
	})
	return recs
}
