package index

import (
	"slices"
	"sync"

	"github.com/kvhost/kvhost/abi"
)

// Pins is the index's part that keeps the entries' counts: the pins of
// loads and clients, hits and last access, the files held open for
// client pins after their entry left the index (pinnedGone), and the
// restart hold's pins (held). Only its operations and Index's change an
// entry's counts. It finds entries in the keyed store (Files) and the
// paths stores are replacing in Flights, and shares the index's lock.
type Pins struct {
	mu      *sync.RWMutex // the Index's
	files   *Files
	flights *Flights
	// pinnedGone holds, by key, the entries dropped from the index while
	// their client pins hold their file open (Entry.File): a load of such
	// a key reads it there until the last of those pins ends, or a load
	// finds the file corrupt (UnkeepPinned).
	// Two such files may hold one key (removed, stored again, removed),
	// each for its own pins: the key stays here until the last goes.
	pinnedGone map[KeyID][]*Entry
	// heldN is the number of indexed entries the restart hold pins
	// (hold.go): those marked held.
	heldN int
	// heldOrder lists each mount's held entries in the order they were
	// held: a demotion round on one mount visits its own held files, not
	// the whole index, in chunks (inHeldChunks). It is only appended to
	// while the hold lasts, so a position stays the same entry between
	// chunks; it keeps entries no longer held (unindexed, released),
	// which visits skip, until the hold ends.
	heldOrder map[int][]*Entry
}

// Hit counts a hit at now on each of ens and returns the policy's
// records of them.
func (p *Pins) Hit(ens []*Entry, now int64) []abi.AccessRecord {
	recs := make([]abi.AccessRecord, len(ens))
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, en := range ens {
		en.hits++
		en.Last = now
		recs[i] = en.Access(abi.AccessHit, now)
	}
	return recs
}

// Touch records uses by other nodes of the indexed files on mount: at
// returns the time of the use of a file by its header id (ok false:
// none); a use later than the file's last access becomes its last
// access, and a hit record of it is returned.
func (p *Pins) Touch(mount int, at func(fid uint64) (int64, bool)) []abi.AccessRecord {
	p.mu.Lock()
	defer p.mu.Unlock()
	var recs []abi.AccessRecord
	for _, en := range p.files.entries {
		if en.Mount != mount {
			continue
		}
		t, ok := at(en.FID)
		if ok && t > en.Last {
			en.Last = t
			recs = append(recs, en.Access(abi.AccessHit, en.Last))
		}
	}
	return recs
}

// PinKey finds the entry of key of fingerprint fp, or the entry a client
// pin holds open out of the index (pinnedGone), and pins it for a load
// (pinLoadLocked); nil where neither has one. An entry held open is
// preferred to an indexed one that is not: a newer file of the key,
// found after the held one left the index, may be removed by its node
// too, and the client's pin promised a load.
func (p *Pins) PinKey(fp uint64, key []byte, dup func(*Entry) bool, now int64, pins *[]abi.AccessRecord) (*Entry, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	en := p.files.getLocked(fp, key)
	if en == nil || en.File.Load() == nil {
		// Dropped from the index (another engine removed its file)
		// while a client pin holds the file open (pinfiles.go).
		if held := p.pinnedGoneLocked(fp, key); held != nil {
			en = held
		}
	}
	if en == nil {
		return nil, false
	}
	return p.pinLoadLocked(en, key, dup, now, pins)
}

// PinFound is PinKey for en, an entry found on disk for key.
func (p *Pins) PinFound(en *Entry, key []byte, dup func(*Entry) bool, now int64, pins *[]abi.AccessRecord) (*Entry, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pinLoadLocked(en, key, dup, now, pins)
}

// pinLoadLocked pins en (or the file it moved to meanwhile, demote.go)
// for a load of key, once per file of the load (dup reports the files it
// pinned already), and appends the policy's pin record to pins. It
// returns the entry and whether the load holds a pin on it.
func (p *Pins) pinLoadLocked(en *Entry, key []byte, dup func(*Entry) bool, now int64, pins *[]abi.AccessRecord) (*Entry, bool) {
	en = p.files.currentLocked(en, key)
	if dup(en) {
		return en, true // another key of this load pinned it
	}
	if en.gone {
		if en.File.Load() == nil {
			return en, false
		}
		en.pins++ // read through the file its client pins hold open; the policy knows it no more
		return en, true
	}
	en.pins++
	*pins = append(*pins, en.Access(abi.AccessPin, now))
	return en, true
}

// UnpinLoad drops a load's pin of each of ens; those loaded count a hit
// at now. It returns the policy's records (hits, unpins) of those still
// indexed.
func (p *Pins) UnpinLoad(ens []*Entry, loaded func(*Entry) bool, now int64) []abi.AccessRecord {
	var recs []abi.AccessRecord
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, en := range ens {
		en.pins--
		if en.gone {
			continue
		}
		if loaded(en) {
			en.hits++
			en.Last = now
			recs = append(recs, en.Access(abi.AccessHit, now))
		}
		recs = append(recs, en.Access(abi.AccessUnpin, now))
	}
	return recs
}

// PinClient takes a client pin (Engine.Pin) of en, found for key, or of
// the file it moved to meanwhile (returned), unless dup says the pin
// holds it already; gone reports an entry no longer indexed, or whose
// file a store replaces now (Flights.Replacing), which is not pinned.
func (p *Pins) PinClient(en *Entry, key []byte, dup func(*Entry) bool) (cur *Entry, isDup, gone bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	en = p.files.currentLocked(en, key) // moved since it was found (demote.go)
	isDup = dup(en)
	gone = en.gone
	if p.flights.replacedLocked(en) {
		gone = true // a store replaces its file now (Engine.replacing)
	}
	if !isDup && !gone {
		en.pins++
		en.leases++
	}
	return en, isDup, gone
}

// HitPinned counts a hit at now on each of ens, just pinned by a client,
// and returns the policy's records (a hit and a pin) of those indexed.
func (p *Pins) HitPinned(ens []*Entry, now int64) []abi.AccessRecord {
	var recs []abi.AccessRecord
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, en := range ens {
		en.hits++
		en.Last = now
		if !en.gone {
			recs = append(recs, en.Access(abi.AccessHit, now), en.Access(abi.AccessPin, now))
		}
	}
	return recs
}

// UnpinClient drops one client pin of each of ens (Engine.Pin) and, with
// tell, returns the policy's unpin records of those still indexed. It
// also returns the files held open for pins that no pin holds now
// (Entry.File), for the caller to release once the lock is let go.
func (p *Pins) UnpinClient(ens []*Entry, now int64, tell bool) ([]abi.AccessRecord, []*PinnedFile) {
	var recs []abi.AccessRecord
	var files []*PinnedFile
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, en := range ens {
		en.pins--
		en.leases--
		if tell && !en.gone {
			recs = append(recs, en.Access(abi.AccessUnpin, now))
		}
		if pf := en.File.Load(); en.leases == 0 && pf != nil {
			files = append(files, pf)
			en.File.Store(nil)
			p.unkeepPinnedLocked(en)
		}
	}
	return recs, files
}

// UnkeepPinned takes en out of pinnedGone, if there: loads of its keys no
// longer read its file, which stays open until its client pins end (a
// file found corrupt: loadFile).
func (p *Pins) UnkeepPinned(en *Entry) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.unkeepPinnedLocked(en)
}

// unkeepPinnedLocked is UnkeepPinned for a caller that holds the lock.
func (p *Pins) unkeepPinnedLocked(en *Entry) {
	for _, k := range en.Keys {
		id := KeyID{en.FP, k}
		if ens := slices.DeleteFunc(p.pinnedGone[id], func(o *Entry) bool { return o == en }); len(ens) > 0 {
			p.pinnedGone[id] = ens
		} else {
			delete(p.pinnedGone, id)
		}
	}
}

// HoldOpen makes pf the file held open for en's client pins, and
// reports true, unless one is held already or no client pin holds en any
// more. An entry already gone is kept for loads (keepPinnedLocked).
func (p *Pins) HoldOpen(en *Entry, pf *PinnedFile) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if en.File.Load() != nil || en.leases <= 0 {
		return false
	}
	en.File.Store(pf)
	if en.gone {
		p.keepPinnedLocked(en)
	}
	return true
}

// keepPinnedLocked lists en, gone from the index and held open for its
// client pins, in pinnedGone under its keys. The caller holds the lock.
func (p *Pins) keepPinnedLocked(en *Entry) {
	if p.pinnedGone == nil {
		p.pinnedGone = map[KeyID][]*Entry{}
	}
	for _, k := range en.Keys {
		id := KeyID{en.FP, k}
		if !slices.Contains(p.pinnedGone[id], en) {
			p.pinnedGone[id] = append(p.pinnedGone[id], en)
		}
	}
}

// pinnedGoneLocked returns an entry of key that its client pins hold open
// although it left the index (pinnedGone; the latest kept of those), or
// nil. The caller holds the lock.
func (p *Pins) pinnedGoneLocked(fp uint64, key []byte) *Entry {
	if len(p.pinnedGone) == 0 {
		return nil // no key kept: every load's case but while pins hold removed files
	}
	if ens := p.pinnedGone[KeyID{fp, string(key)}]; len(ens) > 0 {
		return ens[len(ens)-1]
	}
	return nil
}
