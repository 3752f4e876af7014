package engine

import (
	"context"
	"errors"
	"fmt"
	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/internal/fsys"
	"github.com/kvhost/kvhost/staging"
	"io"
	"sync/atomic"
)

// keyID names a key across namespaces: its geometry fingerprint and bytes.
type keyID struct {
	fp  uint64
	key string
}

type keyRef struct {
	e   *entry
	idx int // index of the key in the file
}

// entry is one published file. Fields other than pins, hits, last and gone
// are immutable after it is indexed.
type entry struct {
	id    uint64
	ns    NamespaceID
	fp    uint64
	mount int
	path  string
	size  int64
	keys  []string
	ident fsys.Identity // of the file when it was indexed
	fid   uint64        // the header's file id (0: written before ids)
	// verified is when the file was last checked (Unix nanoseconds).
	verified atomic.Int64
	// guarded by Engine.mu
	pins   int32
	leases int32 // client pins (Engine.Pin), also counted in pins
	hits   uint32
	last   int64
	gone   bool // removed from the index
	// orphan: unindexed while another job held its path, which removes
	// the file (flight.go); counted in its mount's orphaned until then.
	orphan bool
}

// Index returns the engine's index as a policy host sees it.
func (e *Engine) Index() policy.Index { return indexView{e} }

// indexView implements policy.Index over the engine.
type indexView struct{ e *Engine }

// Lookup returns the entry with the given id.
func (v indexView) Lookup(id uint64) (policy.Entry, bool) {
	e := v.e
	e.mu.Lock()
	defer e.mu.Unlock()
	en, ok := e.entries[id]
	if !ok {
		return policy.Entry{}, false
	}
	return en.policyEntry(), true
}

// Range calls fn for every entry until fn returns false. fn runs without the
// engine's lock held, on a snapshot.
func (v indexView) Range(fn func(policy.Entry) bool) {
	e := v.e
	e.mu.Lock()
	snap := make([]policy.Entry, 0, len(e.entries))
	for _, en := range e.entries {
		snap = append(snap, en.policyEntry())
	}
	e.mu.Unlock()
	for _, en := range snap {
		if !fn(en) {
			return
		}
	}
}

// Namespaces returns every declared namespace.
func (v indexView) Namespaces() []abi.NamespaceRecord {
	e := v.e
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []abi.NamespaceRecord
	for _, ns := range e.nss {
		if ns.declared {
			out = append(out, ns.rec)
		}
	}
	return out
}

func (en *entry) policyEntry() policy.Entry {
	return policy.Entry{
		ID: en.id, KeyHash: abi.KeyHash([]byte(en.keys[0])), Size: uint64(en.size), Mount: uint32(en.mount),
		NS: uint32(en.ns), LastAccess: uint64(en.last), Hits: en.hits, Pins: uint32(en.pins),
	}
}

func (en *entry) access(kind uint32, t int64) abi.AccessRecord {
	return abi.AccessRecord{
		Entry: en.id, Time: uint64(t), Size: uint64(en.size), KeyHash: abi.KeyHash([]byte(en.keys[0])),
		Kind: kind, Mount: uint32(en.mount), NS: uint32(en.ns), Hits: en.hits,
	}
}

// insertLocked indexes en, replacing any entry at its path or holding its
// keys (returned, already unindexed).
func (e *Engine) insertLocked(en *entry) []*entry {
	var replaced []*entry
	if old := e.byPath[en.path]; old != nil {
		e.unindexLocked(old)
		replaced = append(replaced, old)
	}
	e.lastID++
	en.id = e.lastID
	e.entries[en.id] = en
	e.byPath[en.path] = en
	for i, k := range en.keys {
		e.byKey[keyID{en.fp, k}] = keyRef{e: en, idx: i}
		if e.keys != nil {
			e.keys.Add(en.fp, k)
		}
	}
	m := e.mounts[en.mount]
	m.used += en.size
	m.entries++
	return replaced
}

// relinkLocked indexes en again for those of its keys that the index does
// not find (the key's entry pointed at another file, since dropped). It
// reports false if en is no longer indexed.
func (e *Engine) relinkLocked(en *entry) bool {
	if en.gone {
		return false
	}
	for i, k := range en.keys {
		if _, ok := e.byKey[keyID{en.fp, k}]; !ok {
			e.byKey[keyID{en.fp, k}] = keyRef{e: en, idx: i}
			if e.keys != nil {
				e.keys.Add(en.fp, k)
			}
		}
	}
	return true
}

// unindexLocked removes en from the index.
func (e *Engine) unindexLocked(en *entry) {
	if en.gone {
		return
	}
	en.gone = true
	delete(e.entries, en.id)
	if e.byPath[en.path] == en {
		delete(e.byPath, en.path)
	}
	for _, k := range en.keys {
		if ref, ok := e.byKey[keyID{en.fp, k}]; ok && ref.e == en {
			delete(e.byKey, keyID{en.fp, k})
			if e.keys != nil {
				e.keys.Remove(en.fp, k)
			}
		}
	}
	m := e.mounts[en.mount]
	m.used -= en.size
	m.entries--
}

// drop removes en from the index, tells the policy, and, if remove is set,
// removes its file (holding its path meanwhile, so that a store publishing
// a new file there waits and its file is never the one removed). It
// reports whether en was still indexed, that is, whether this call
// dropped it.
func (e *Engine) drop(ctx context.Context, en *entry, remove bool, why string) bool {
	e.mu.Lock()
	was := !en.gone
	e.unindexLocked(en)
	rec := en.access(abi.AccessRemove, e.now().UnixNano())
	claimed := was && remove && e.removeLocked(en)
	e.mu.Unlock()
	if !was {
		return false
	}
	if claimed {
		e.removeClaimed(en)
	}
	e.log.Debug("engine: entry dropped", "path", en.path, "why", why)
	e.access(ctx, []abi.AccessRecord{rec})
	return true
}

// adopt indexes an entry found on disk and tells the policy. It returns
// the indexed entry, or nil where a job of this engine holds the path (a
// store about to publish there, a removal): only the holder indexes a
// file at a path it holds, so that a store's view of the file it replaces
// (group.old) stays true until it publishes.
func (e *Engine) adopt(ctx context.Context, en *entry) *entry {
	e.mu.Lock()
	if old := e.byPath[en.path]; old != nil && old.ident.Same(en.ident) && old.fid == en.fid {
		e.relinkLocked(old) // found by a key the index had lost
		e.mu.Unlock()
		return old
	}
	if e.inflight[en.path] != nil {
		e.mu.Unlock()
		return nil
	}
	id, ok := e.nsByFP[en.fp]
	if !ok {
		id = e.newNamespaceLocked(en.fp)
	}
	en.ns = id
	replaced := e.insertLocked(en)
	var recs []abi.AccessRecord
	for _, r := range replaced {
		recs = append(recs, r.access(abi.AccessRemove, en.last))
	}
	recs = append(recs, en.access(abi.AccessInsert, en.last))
	e.mu.Unlock()
	e.access(ctx, recs)
	return en
}

func (en *entry) match(fp uint64, key []byte) (int, error) {
	if en.fp != fp {
		return -1, fmt.Errorf("%w: %w: file 0x%016x, want 0x%016x", ErrMismatch, format.ErrFingerprint, en.fp, fp)
	}
	for i, k := range en.keys {
		if k == string(key) {
			return i, nil
		}
	}
	return -1, fmt.Errorf("%w: %w", ErrMismatch, format.ErrKey)
}

// errNotRegular: a name where a kvhost file should be is not a regular
// file (a directory, a socket...).
var errNotRegular = errors.New("engine: not a regular file")

// readEntry reads the header of the file at path into an unindexed entry.
func (e *Engine) readEntry(mnt int, path string) (*entry, error) {
	if e.mounts[mnt].raw != nil {
		return e.rawEntry(mnt, path)
	}
	// The identity is that of the file whose header is read.
	f, id, err := e.openRegular(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	h, err := readHeader(f)
	if err != nil {
		return nil, err
	}
	if id.Size < h.FileLen() {
		return nil, fmt.Errorf("%w: %s: %d bytes, header says %d", ErrCorrupt, path, id.Size, h.FileLen())
	}
	return e.entryOf(mnt, path, h, id), nil
}

// entryOf returns an unindexed entry for the file at path with header h
// and identity id.
func (e *Engine) entryOf(mnt int, path string, h *format.Header, id fsys.Identity) *entry {
	en := &entry{fp: h.Fingerprint, mount: mnt, path: path, size: id.Size, ident: id, fid: h.ID, last: id.Mtime}
	en.verified.Store(e.now().UnixNano())
	for _, k := range h.Keys {
		en.keys = append(en.keys, string(k.Key))
	}
	return en
}

// readHeader reads and decodes the header at the start of f, with aligned
// buffers so that it works on files opened with O_DIRECT.
func readHeader(f fsys.File) (*format.Header, error) {
	buf := staging.AlignedBuffer(format.Align)
	n, err := f.ReadAt(buf, 0)
	if n < format.FixedLen {
		if err == nil || errors.Is(err, io.EOF) {
			err = format.ErrTruncated
		}
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	h, err := format.Decode(buf[:n])
	var te *format.TruncatedError
	if errors.As(err, &te) && te.Need <= format.MaxHeaderLen && n == len(buf) {
		buf = staging.AlignedBuffer((te.Need + format.Align - 1) / format.Align * format.Align)
		if n, _ = f.ReadAt(buf, 0); n < te.Need {
			return nil, fmt.Errorf("%w: %w", ErrCorrupt, format.ErrTruncated)
		}
		h, err = format.Decode(buf[:n])
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return h, nil
}
