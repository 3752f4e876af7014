package engine

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/internal/engine/removals"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// Objects is an object mount behind the file mounts (Config.Objects;
// package objstore): one object per key, in the file format, shared by
// every node of a bucket and kept across restarts and node replacement.
// The engine loads a key from it where no file of its mounts holds the
// key, straight into the cache's blocks through the store's mover (each
// read of the file it opens is a ranged request), verified as a file's
// load is;
// and it tells it of every one-key file it publishes, which the store may
// copy in the background. Its methods may be called from many goroutines
// at once.
type Objects interface {
	// Has reports whether the store is known to hold key of the namespace
	// of fingerprint fp, from what it keeps in memory: no request.
	Has(fp uint64, key []byte) bool
	// Open opens key's object for reading. Its reads are requests bounded
	// by ctx and by the store's own timeouts; a read of an object the
	// store lacks fails with an error matching fs.ErrNotExist.
	Open(ctx context.Context, fp uint64, key []byte) (fsys.File, error)
	// Published tells the store of the file at path that the engine has
	// just published, holding key alone, of namespace fp, to copy in the
	// background. It must not block on the store.
	Published(fp uint64, key []byte, path string)
	// Bad tells the store that its object of key failed the load's
	// checks (err says how): it forgets, and may remove, the object.
	Bad(fp uint64, key []byte, err error)
	// Delete forgets key's object at once and removes it from the store
	// (a client deleted the key). It must not block on the store.
	Delete(fp uint64, key []byte)
	// Upload copies the file at path, holding key alone with payload
	// checksums, of namespace fp, to key's object now (a demotion to the
	// object mount); an error matching syscall.ENOSPC says the store has
	// no room. ctx bounds it.
	Upload(ctx context.Context, fp uint64, key []byte, path string) error
	// Usage returns the bytes and the number of the objects the store
	// knows of, and its bound (0: none), for the policy's description.
	Usage() (used, capacity int64, objects int)
	// Purge removes every object of the namespace of fingerprint fp and
	// returns the keys it removed; an error says what it could not
	// remove. ctx bounds it.
	Purge(ctx context.Context, fp uint64) ([][]byte, error)
	// OnGone sets fn to be told of every object that leaves the store
	// other than by Delete, Bad or Purge: evicted for room (evicted
	// true), or found gone (another node removed it). fn does not call
	// the store.
	OnGone(fn func(fp uint64, key []byte, evicted bool))
	// Mover moves the plans of the files Open returns into host memory,
	// computing their checksums. Memory the CPU cannot address (a GPU's)
	// is loaded from a copy of the whole object in the daemon's memory,
	// verified there, by the memory kind's mover of the first mount.
	Mover() transfer.Mover
}

// objectHeaderRead is the first read of an object's header: the header
// area of a file of up to 55 keys, which a one-key object always is.
const objectHeaderRead = 4096

// objectTier is the engine's part that serves keys from the object mount
// (Config.Objects): the keys no file holds. It reads the engine's index
// (find), counts in its counters and marks its I/O in flight; Open sets
// it, and it never changes after.
type objectTier struct {
	objs   Objects                                // nil: no object mount
	find   func(ns *namespace, key []byte) *entry // the engine's index
	mounts []*mount                               // the engine's: the first one's movers move what the CPU cannot address
	rm     *remover                               // its feed records the objects' removals
	bounce bouncePool                             // the memory files of loads into memory the CPU cannot address
	// lazy reports whether the policy decides what the object mount
	// takes (it demotes: tiering.demotes): then a published file is
	// copied only where admission sent it there, else every one is. Set
	// once at Open; nil: never.
	lazy func() bool
	// promoter promotes keys loaded whole from the object mount where the
	// policy decides (objpromote.go); nil without an object mount.
	promoter *objectPromoter
	// slots bounds the keys loads read from the object mount at once
	// (Config.ObjectKeys): a token per key, taken instead of a file slot.
	slots chan struct{}
	st    *counters
	io    *fsys.InFlight
	log   *slog.Logger
	// lost counts the objects that left the object mount behind the
	// engine's calls (gone): the demoter's cue that a key it uploaded may
	// need uploading again.
	lost atomic.Uint64
}

// DefaultObjectKeys is the least Config.ObjectKeys: the keys a load
// reads from the object mount at once. With 4 at once, 8 keys of 8 MiB
// from a one-host RGW loaded at 0.82-0.93 of the S3 client's own 32
// parallel GETs of the same objects; with 8, at 0.89-1.01.
const DefaultObjectKeys = 16

// takeSlot takes one of the object mount's key slots (giveSlot gives it
// back), or fails with ctx's error.
func (o *objectTier) takeSlot(ctx context.Context) error {
	select {
	case o.slots <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// giveSlot gives back a slot takeSlot took.
func (o *objectTier) giveSlot() { <-o.slots }

// objectClass is the device class the removal feed names the object
// mount by (removals.Feed.SetMounts), at the index one past the engine's
// mounts (objectTier.index).
const objectClass = "object"

// index is the object mount's index in the removal feed's records: one
// past the engine's mounts.
func (o *objectTier) index() int { return len(o.mounts) }

// watch has the object mount tell the feed of the objects that leave it
// behind the engine's calls (Objects.OnGone).
func (o *objectTier) watch() {
	if o.objs != nil {
		o.objs.OnGone(o.gone)
	}
}

// gone records on the removal feed that key's object left the object
// mount, evicted for room or found gone, where no file holds the key:
// else the key is still stored.
func (o *objectTier) gone(fp uint64, key []byte, evicted bool) {
	o.lost.Add(1)
	reason := removals.Vanished
	if evicted {
		reason = removals.Evicted
	}
	o.record(fp, [][]byte{key}, reason)
}

// record records on the removal feed that keys of the namespace of fp
// left the object mount for reason, those no file holds.
func (o *objectTier) record(fp uint64, keys [][]byte, reason removals.Reason) {
	if !o.rm.feed.Recording() {
		return
	}
	recs := make([]removals.Record, 0, len(keys))
	for _, k := range keys {
		if o.rm.ix.Files().Get(fp, k) == nil {
			recs = append(recs, removals.Record{FP: fp, Key: string(k), Reason: reason, Mount: o.index(), To: removals.NoMount})
		}
	}
	o.rm.feed.Publish(recs...)
}

// purge removes the objects of the namespaces of fps, records them
// purged where no file holds their keys, and counts them in res.
func (o *objectTier) purge(ctx context.Context, fps []uint64, res *PurgeResult) error {
	if o.objs == nil {
		return nil
	}
	var errs []error
	for _, fp := range fps {
		keys, err := o.objs.Purge(ctx, fp)
		o.record(fp, keys, removals.Purged)
		res.Objects += len(keys)
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// holds reports whether the object mount holds key of the namespace of
// fp (from memory): a file evicted then leaves the key stored there.
func (o *objectTier) holds(fp uint64, key []byte) bool {
	return o.objs != nil && o.objs.Has(fp, key)
}

// has reports whether the object mount holds key of ns (from memory:
// Objects.Has); false without an object mount.
func (o *objectTier) has(ns *namespace, key []byte) bool {
	return o.objs != nil && ns.layout == nil && o.objs.Has(ns.fp, key)
}

// published tells the object mount of a file a store published, to copy
// in the background: every one, or with a policy that decides (lazy)
// those admission sent to the object mount (admitted).
func (o *objectTier) published(h *format.Header, path string, admitted bool) {
	if o.objs != nil && len(h.Keys) == 1 && !h.Raw && (admitted || o.lazy == nil || !o.lazy()) {
		o.objs.Published(h.Fingerprint, h.Keys[0].Key, path)
	}
}

// description describes the object mount to the policy: the last mount, at
// index, with MOUNT_OBJECT. ok is false without an object mount.
func (o *objectTier) description() (r abi.MountRecord, ok bool) {
	if o.objs == nil {
		return r, false
	}
	used, capacity, n := o.objs.Usage()
	r.Mount, r.Flags, r.Class = uint32(o.index()), abi.MountObject|abi.MountChecksums, abi.ClassNetwork
	r.Capacity, r.Used, r.Entries = uint64(max(capacity, 0)), uint64(max(used, 0)), uint64(n)
	r.Free = uint64(max(capacity-used, 0))
	r.High, r.Low = r.Capacity, uint64(float64(r.Capacity)*0.9)
	copy(r.FSName[:], "s3")
	copy(r.Backend[:], "s3")
	return r, true
}

// copy copies the file at path, of keys of namespace fp, to the object
// mount now, unless it holds the key already (a demotion there), and
// reports whether it sent the file. A file of several keys is not copied
// (ErrPolicy).
func (o *objectTier) copy(ctx context.Context, fp uint64, keys []string, path string) (sent bool, err error) {
	if len(keys) != 1 {
		return false, fmt.Errorf("%w: the object mount takes files of one key, %s holds %d", ErrPolicy, path, len(keys))
	}
	if o.objs.Has(fp, []byte(keys[0])) {
		return false, nil
	}
	if err := o.objs.Upload(ctx, fp, []byte(keys[0]), path); err != nil {
		return false, err
	}
	return true, nil
}

// only returns the keys (of the set keys) of ns that the object mount
// holds and no file does.
func (o *objectTier) only(ns *namespace, keys map[string]bool) [][]byte {
	if o.objs == nil {
		return nil
	}
	var out [][]byte
	for k := range keys {
		if o.find(ns, []byte(k)) == nil && o.has(ns, []byte(k)) {
			out = append(out, []byte(k))
		}
	}
	return out
}

// remove removes from the object mount the objects of keys of ns (a
// client deleted them).
func (o *objectTier) remove(ns *namespace, keys [][]byte) {
	for _, k := range keys {
		o.objs.Delete(ns.fp, k)
	}
}

// load loads the layers lr of key i of the request from the object
// mount into its blocks, verifying the object's header and checksums as
// a file's, and sets its outcome.
func (o *objectTier) load(ctx context.Context, j *Job, c *cache, keys [][]byte, blocks [][]int, lr LayerRange, i int) {
	set := func(out Outcome, err error) { j.res.Keys[i] = KeyResult{Outcome: out, Err: err} }
	obj, fp, key := o.objs, c.ns.fp, keys[i]
	bad := func(err error) {
		o.st.corrupt.Add(1)
		o.log.Warn("engine: corrupt object", "key", fmt.Sprintf("%x", key), "err", err)
		obj.Bad(fp, key, err)
		set(OutcomeFailed, err)
	}
	f, err := obj.Open(ctx, fp, key)
	if err != nil {
		set(OutcomeFailed, fmt.Errorf("engine: load object of key %x: %w", key, err))
		return
	}
	defer f.Close()
	h, err := readObjectHeader(f)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		o.st.misses.Add(1)
		set(OutcomeMissing, fmt.Errorf("%w: key %x: %w", ErrNotFound, key, err))
		return
	case errors.Is(err, ErrCorrupt):
		bad(fmt.Errorf("object of key %x: %w", key, err))
		return
	case err != nil:
		set(OutcomeFailed, fmt.Errorf("engine: load object of key %x: %w", key, err))
		return
	}
	k, err := checkObjectHeader(h, c.ns, key)
	if err != nil {
		bad(err)
		return
	}
	want := make([]bool, len(h.Keys))
	want[k] = true
	if c.kind != region.KindHost {
		o.loadBounced(ctx, j, c, blocks[i], lr, i, f, h, k, want, bad)
		return
	}
	by := verifyKeys
	if !lr.all() && h.LayerSums != nil {
		by = verifyLayers
	}
	plan, sk := c.plan(h, want, func(int) []int { return blocks[i] }, &mount{}, lr, by)
	sums := make([]uint32, plan.Sums)
	err = readPlan(ctx, obj.Mover(), f, plan, sk, sums, o.io)
	if isShort(err) {
		bad(fmt.Errorf("%w: object of key %x: %w", ErrCorrupt, key, err))
		return
	}
	if err != nil {
		set(OutcomeFailed, fmt.Errorf("engine: load object of key %x: %w", key, err))
		return
	}
	switch errs, corrupt := verifyRead(ctx, f, h, sk, sums, []int{k}, fmt.Sprintf("object of key %x", key)); {
	case corrupt:
		bad(errs[k])
		return
	case errs != nil:
		set(OutcomeFailed, errs[k])
		return
	}
	o.loaded(j, i, lr, by == verifyKeys, sk.moved[k]+sk.skipped[k], sk.moved[k])
	if o.promoting(lr) && !slices.Contains(blocks[i], NoBlock) {
		o.promoteFromBlocks(c, h, k, blocks[i])
	}
}

// promoting reports whether a key loaded from the object mount with the
// layers lr is offered for promotion to a file mount: loaded whole, where
// the policy decides what the object mount takes (lazy), and the
// promoter has room for it.
func (o *objectTier) promoting(lr LayerRange) bool {
	return o.promoter != nil && lr.all() && o.lazy != nil && o.lazy() && o.promoter.room()
}

// promoteFromBlocks offers key k of the object of header h, just loaded
// and verified into blocks of c's host memory, for promotion: a copy of
// its blocks in the daemon's memory, made before the load answers (the
// client may write its blocks from then on); the promoter checks the
// copy's checksum before it stores it.
func (o *objectTier) promoteFromBlocks(c *cache, h *format.Header, k int, blocks []int) {
	obj := o.promoter.buffer(h.FileLen())
	hl, bb := int64(h.Len()), int64(h.BlockBytes)
	want := make([]bool, len(h.Keys))
	want[k] = true
	h.Walk(want, func(_, b, l, p int, off int64) {
		t := &c.layers[l]
		src := t.Region.(region.Addressable).Bytes() // a host cache's (RegisterCache)
		at := t.Offset + int64(p)*t.PlaneStride + int64(blocks[b])*t.BlockStride
		copy(obj[hl+off:hl+off+bb], src[at:at+bb])
	})
	o.promoter.offer(promotion{ns: c.ns.id, fp: c.ns.fp, geo: c.ns.geo, key: bytes.Clone(h.Keys[k].Key), h: h, k: k, obj: obj, release: func() { o.promoter.giveBack(obj) }})
}

// loaded sets key i of j loaded from the object mount and counts it
// (counters.loaded).
func (o *objectTier) loaded(j *Job, i int, lr LayerRange, byKey bool, read, moved int64) {
	j.res.Keys[i] = KeyResult{Outcome: OutcomeLoaded}
	o.st.loaded(j, lr, byKey, read, moved)
}

// checkObjectHeader checks the header h of key's object against the
// namespace ns, whose object it is meant to be: it returns the key's
// index in h, or an error wrapping ErrCorrupt where h names another
// namespace or key, another geometry, or no payload checksums (every
// load from the object mount is verified).
func checkObjectHeader(h *format.Header, ns *namespace, key []byte) (int, error) {
	k, err := h.Match(ns.fp, key)
	switch {
	case err != nil:
		return 0, fmt.Errorf("%w: object of key %x holds another: %w", ErrCorrupt, key, err)
	case !ofGeometry(h, ns.geo):
		return 0, fmt.Errorf("%w: object of key %x: its geometry (%d layers, %d planes, %d blocks of %d bytes) is not its namespace's", ErrCorrupt, key, h.Layers, h.Planes, h.BlocksPerKey, h.BlockBytes)
	case h.Flags&format.FlagPayloadSums == 0:
		return 0, fmt.Errorf("%w: object of key %x has no payload checksums, and objects are verified on every load", ErrCorrupt, key)
	}
	return k, nil
}

// loadBounced loads key k of the object open as f, whose header h
// was checked, into blocks of c's memory that the CPU cannot address (a
// GPU's): the whole object is read into a memory file of the daemon's,
// the key verified there, and the memory kind's mover (of the first
// mount) moves it from that file as from a file on tmpfs.
func (o *objectTier) loadBounced(ctx context.Context, j *Job, c *cache, blocks []int, lr LayerRange, i int, f fsys.File, h *format.Header, k int, want []bool, bad func(error)) {
	set := func(out Outcome, err error) { j.res.Keys[i] = KeyResult{Outcome: out, Err: err} }
	key := h.Keys[k].Key
	mv, err := o.mounts[0].mover(c.kind)
	if err != nil {
		set(OutcomeFailed, err)
		return
	}
	b, err := o.bounce.get(h.FileLen())
	if err != nil {
		set(OutcomeFailed, fmt.Errorf("engine: load object of key %x: %w", key, err))
		return
	}
	kept := false // the promoter took b
	defer func() {
		if !kept {
			o.bounce.put(b)
		}
	}()
	bf, mem := b.f, b.mem[:h.FileLen()]
	io := o.io.Begin()
	defer o.io.End(io)
	if !lr.all() && h.LayerSums != nil {
		o.loadBouncedLayers(ctx, j, c, blocks, lr, i, f, h, k, want, bad, mv, bf, mem)
		return
	}
	n, err := f.ReadvAt([][]byte{mem}, 0)
	if err == nil && int64(n) < h.FileLen() {
		bad(fmt.Errorf("%w: object of key %x: %d bytes, the header says %d", ErrCorrupt, key, n, h.FileLen()))
		return
	}
	if err != nil {
		set(OutcomeFailed, fmt.Errorf("engine: load object of key %x: %w", key, err))
		return
	}
	// Verified in the daemon's memory, which no client writes: a
	// mismatch is the object's.
	if sums := memorySums(mem, h, want); sums[k] != h.Keys[k].Sum {
		bad(fmt.Errorf("%w: object of key %x: payload checksum 0x%08x, want 0x%08x", ErrCorrupt, key, sums[k], h.Keys[k].Sum))
		return
	}
	plan, sk := c.plan(h, want, func(int) []int { return blocks }, &mount{mountFS: mountFS{memory: true}}, lr, verifyNone)
	if _, err := mv.ReadFile(ctx, bf, plan, nil); err != nil {
		set(OutcomeFailed, fmt.Errorf("engine: load object of key %x: %w", key, err))
		return
	}
	o.loaded(j, i, lr, false, h.FileLen(), sk.moved[k])
	if o.promoting(lr) {
		// The object, verified in b, is promoted from there: b goes
		// back to the pool once the promotion has copied it.
		kept = true
		o.promoter.offer(promotion{ns: c.ns.id, fp: c.ns.fp, geo: c.ns.geo, key: bytes.Clone(key), h: h, k: k, obj: mem, release: func() { o.bounce.put(b) }})
	}
}

// loadBouncedLayers is loadBounced of a layer range of an object with
// layer checksums: only the range's bytes of key k are read (ranged
// requests, one per run of them in the object), into their offsets in
// the memory file mem (bf), and verified there by their layers'
// checksums before the mover moves them. A layer-wise load of a key then
// reads each byte of the object once, not the whole object per layer
// group. The memory is the daemon's: a mismatch is the object's.
func (o *objectTier) loadBouncedLayers(ctx context.Context, j *Job, c *cache, blocks []int, lr LayerRange, i int, f fsys.File, h *format.Header, k int, want []bool, bad func(error), mv transfer.Mover, bf fsys.File, mem []byte) {
	set := func(out Outcome, err error) { j.res.Keys[i] = KeyResult{Outcome: out, Err: err} }
	key := h.Keys[k].Key
	hl, bb := int64(h.Len()), int64(h.BlockBytes)
	segs := make([][]int64, lr.Count) // per layer of the range, its segments' offsets in the object
	h.Walk(want, func(kk, _, l, _ int, off int64) {
		if kk == k && l >= lr.First && l < lr.First+lr.Count {
			segs[l-lr.First] = append(segs[l-lr.First], hl+off)
		}
	})
	var all []int64
	for _, s := range segs {
		slices.Sort(s)
		all = append(all, s...)
	}
	slices.Sort(all)
	var runs [][2]int64 // [start, end) in the object: the segments, joined where they touch
	for _, start := range all {
		if n := len(runs); n > 0 && runs[n-1][1] == start {
			runs[n-1][1] = start + bb
			continue
		}
		runs = append(runs, [2]int64{start, start + bb})
	}
	var read int64
	for _, r := range runs {
		n, err := f.ReadvAt([][]byte{mem[r[0]:r[1]]}, r[0])
		read += int64(n)
		if err == nil && int64(n) < r[1]-r[0] {
			bad(fmt.Errorf("%w: object of key %x: %d bytes at %d, the header says %d", ErrCorrupt, key, n, r[0], r[1]-r[0]))
			return
		}
		if err != nil {
			set(OutcomeFailed, fmt.Errorf("engine: load object of key %x: %w", key, err))
			return
		}
	}
	for x, s := range segs {
		l := lr.First + x
		var sum uint32
		for _, off := range s {
			sum = crc32c.Update(sum, mem[off:off+bb])
		}
		if wantSum := h.LayerSum(k, l); sum != wantSum {
			bad(fmt.Errorf("%w: object of key %x: layer %d checksum 0x%08x, want 0x%08x", ErrCorrupt, key, l, sum, wantSum))
			return
		}
	}
	plan, sk := c.plan(h, want, func(int) []int { return blocks }, &mount{mountFS: mountFS{memory: true}}, lr, verifyNone)
	if _, err := mv.ReadFile(ctx, bf, plan, nil); err != nil {
		set(OutcomeFailed, fmt.Errorf("engine: load object of key %x: %w", key, err))
		return
	}
	o.loaded(j, i, lr, false, read, sk.moved[k])
}

// memorySums returns the CRC-32C of the payload of the keys marked in
// want of a file whose bytes are mem, computed as recheck computes them
// from a file, without a copy.
func memorySums(mem []byte, h *format.Header, want []bool) []uint32 {
	hl, bb := int64(h.Len()), int64(h.BlockBytes)
	sums := make([]uint32, len(h.Keys))
	h.Walk(want, func(k, _, _, _ int, off int64) {
		sums[k] = crc32c.Update(sums[k], mem[hl+off:hl+off+bb])
	})
	return sums
}

// maxIdleBounces is the most memory files of bounced loads the pool
// keeps between loads: as many as loads of objects may run at once with
// the default file slots, each the size of one object.
const maxIdleBounces = 8

// bouncePool keeps the memory files of bounced loads (loadBounced) for
// the next, instead of a memfd made, truncated, mapped and faulted in
// per load (BenchmarkObjectBounce measures the two). Objects of one
// geometry are all of one size; a file is taken for a load of an object
// no larger, and the pool keeps at most maxIdleBounces of the largest.
// Its zero value is an empty pool.
type bouncePool struct {
	mu     sync.Mutex
	idle   []*bounce // largest last
	closed bool
}

// bounce is a memory file of the pool: f open read-write, mapped as mem.
type bounce struct {
	f       fsys.File
	mem     []byte
	release func()
}

// get returns a memory file of at least size bytes: an idle one of the
// pool (the smallest that fits), else a new one.
func (p *bouncePool) get(size int64) (*bounce, error) {
	p.mu.Lock()
	for i, b := range p.idle {
		if int64(len(b.mem)) >= size {
			p.idle = slices.Delete(p.idle, i, i+1)
			p.mu.Unlock()
			return b, nil
		}
	}
	p.mu.Unlock()
	f, mem, release, err := memoryFile("kvhost-object", size)
	if err != nil {
		return nil, err
	}
	return &bounce{f: f, mem: mem, release: release}, nil
}

// put gives b back to the pool, or releases it where the pool is full
// (the smallest goes) or closed.
func (p *bouncePool) put(b *bounce) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		b.release()
		return
	}
	i, _ := slices.BinarySearchFunc(p.idle, len(b.mem), func(x *bounce, n int) int { return cmp.Compare(len(x.mem), n) })
	p.idle = slices.Insert(p.idle, i, b)
	var drop *bounce
	if len(p.idle) > maxIdleBounces {
		drop = p.idle[0]
		p.idle = slices.Delete(p.idle, 0, 1)
	}
	p.mu.Unlock()
	if drop != nil {
		drop.release()
	}
}

// close releases the idle memory files; those of loads under way go when
// they end.
func (p *bouncePool) close() {
	p.mu.Lock()
	idle := p.idle
	p.idle, p.closed = nil, true
	p.mu.Unlock()
	for _, b := range idle {
		b.release()
	}
}

// memoryFile makes an anonymous memory file (a memfd region) of size
// bytes, open read-write as an fsys.File and mapped as mem; release
// closes both.
func memoryFile(name string, size int64) (f fsys.File, mem []byte, release func(), err error) {
	h, err := region.NewHost(name, size)
	if err != nil {
		return nil, nil, nil, err
	}
	f, err = fsys.OS{}.OpenFile(fmt.Sprintf("/proc/self/fd/%d", h.Fd()), os.O_RDWR, 0)
	if err != nil {
		h.Close()
		return nil, nil, nil, err
	}
	return f, h.Bytes(), func() { f.Close(); h.Close() }, nil
}

// readObjectHeader reads and decodes the header of an object open as f:
// an error of the read as it is, one of the header wrapping ErrCorrupt.
func readObjectHeader(f fsys.File) (*format.Header, error) {
	b := make([]byte, objectHeaderRead)
	n, err := f.ReadAt(b, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	b = b[:n]
	hl, err := format.Peek(b)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	if hl > len(b) {
		b = make([]byte, hl)
		if _, err := f.ReadAt(b, 0); err != nil {
			if errors.Is(err, io.EOF) {
				return nil, fmt.Errorf("%w: a header of %d bytes, the object shorter", ErrCorrupt, hl)
			}
			return nil, err
		}
	}
	h, err := format.Decode(b)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return h, nil
}
