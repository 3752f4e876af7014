package engine

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/transfer"
)

// Store stores keys from cache blocks, asynchronously. The request is
// validated at once; the returned Job reports, per key, stored, present, not
// admitted or failed. Consecutive keys are grouped into files of the
// namespace's KeysPerFile. Cancelling ctx cancels the job. The caller must
// not modify the blocks until the job is done.
func (e *Engine) Store(ctx context.Context, req StoreRequest) (*Job, error) {
	c, err := e.tables.request(req.Cache, req.Keys, req.Blocks, false)
	if err != nil {
		return nil, err
	}
	keys, blocks := cloneRequest(req.Keys, req.Blocks)
	j, jctx, err := e.newJob(ctx, "store", len(keys))
	if err != nil {
		return nil, err
	}
	j.mem = c.kind
	go e.runStore(jctx, j, c, keys, blocks)
	return j, nil
}

func cloneRequest(keys [][]byte, blocks [][]int) ([][]byte, [][]int) {
	k := make([][]byte, len(keys))
	b := make([][]int, len(blocks))
	for i := range keys {
		k[i] = slices.Clone(keys[i])
		b[i] = slices.Clone(blocks[i])
	}
	return k, b
}

// group is the keys (request indices) of one file to store.
type group struct {
	idx   []int
	mount int
	path  string
	hdr   *format.Header
	held  bool // the first key is in the indexed file at path: not written
	// old is the entry indexed at path when the store claimed it (nil:
	// none), the file its own replaces.
	old *entry
	// released: the store released path when it indexed its file.
	released bool
	// toObjects: admission sent the file to the object mount; it is
	// written at path and copied there once published (demote.go,
	// retarget).
	toObjects bool
}

// maxStoreRounds bounds how many times a store waits for another job that
// holds one of its files' paths before it gives up on those keys.
const maxStoreRounds = 8

func (e *Engine) runStore(ctx context.Context, j *Job, c *cache, keys [][]byte, blocks [][]int) {
	defer e.finish(j)
	// A key repeated in the request is stored once; every occurrence gets
	// the outcome of the first.
	first := make([]int, len(keys))
	firstOf := map[string]int{}
	var todo []int
	for i, k := range keys {
		if f, ok := firstOf[string(k)]; ok {
			first[i] = f
			continue
		}
		firstOf[string(k)], first[i] = i, i
		todo = append(todo, i)
	}
	defer func() { // runs before finish
		for i, f := range first {
			if f != i {
				j.res.Keys[i] = j.res.Keys[f]
			}
		}
	}()

	// The entry of every key answered present. A later file of this job
	// may be renamed over it (its first key, lost from the index, is
	// stored again under its own name, where that file is): such keys are
	// looked at again, so that `present` is never answered for a file
	// this store itself replaced.
	presentIn := map[int]*entry{}
	for round := 0; ; round++ {
		// Keys already stored (and still on disk: the file's header is
		// read, so that a file another node put in its place, even at the
		// same inode, is never taken for it) are present.
		var missing []int
		checked := map[*entry]bool{}
		found := e.ix.Files().GetAll(c.ns.fp, keys, todo)
		for t, i := range todo {
			en := found[t]
			for en != nil {
				ok, seen := checked[en]
				if !seen {
					ok = e.shared.confirm(ctx, en)
					checked[en] = ok
				}
				if ok {
					break
				}
				// Moved to another mount since it was found (demote.go):
				// the key's entry is then the copy, checked in turn.
				cur := e.ix.Files().Current(en, keys[i])
				if cur == en {
					cur = nil
				}
				en = cur
			}
			if en != nil {
				j.res.Keys[i] = KeyResult{Outcome: OutcomePresent}
				presentIn[i] = en
				continue
			}
			missing = append(missing, i)
		}
		if len(missing) == 0 {
			return
		}
		var err error
		switch {
		case ctx.Err() != nil:
			err = ctx.Err()
		case round == maxStoreRounds:
			err = fmt.Errorf("engine: store: the file's path was held by other jobs %d times in a row", round)
		}
		if err != nil {
			for _, i := range missing {
				j.res.Keys[i] = KeyResult{Outcome: OutcomeFailed, Err: err}
			}
			return
		}
		// Keys whose file's path another job holds wait for it, then are
		// looked at again: stored by it (present), or stored anew in the
		// next round, grouped afresh (so a file holding other keys under
		// the same name is never taken for theirs).
		var busy []*flight
		todo, busy = e.storeRound(ctx, j, c, keys, blocks, missing)
		if len(presentIn) > 0 {
			for i, en := range presentIn {
				if e.ix.Files().Gone(en) {
					delete(presentIn, i)
					todo = append(todo, i)
				}
			}
		}
		slices.Sort(todo) // request order: files are grouped from it
		if len(busy) > 0 {
			e.st.pathWaits.Add(1)
		}
		for _, fl := range busy {
			select {
			case <-fl.Done:
			case <-ctx.Done():
			}
		}
	}
}

// storeRound stores the keys todo (request indices): it groups them into
// files, names them, asks admission and writes every file whose path it
// can hold. It returns the keys of files whose path another job holds, and
// those jobs' flights, for the caller to wait on.
func (e *Engine) storeRound(ctx context.Context, j *Job, c *cache, keys [][]byte, blocks [][]int, todo []int) ([]int, []*flight) {
	ns := c.ns
	set := func(i int, o Outcome, err error) { j.res.Keys[i] = KeyResult{Outcome: o, Err: err} }
	failAll := func(idx []int, err error) {
		for _, i := range idx {
			set(i, OutcomeFailed, err)
		}
	}

	// Files: runs of KeysPerFile consecutive keys, named by their first key.
	var groups []*group
	for start := 0; start < len(todo); start += ns.keysPerFile {
		groups = append(groups, &group{idx: todo[start:min(len(todo), start+ns.keysPerFile)]})
	}
	firsts := make([][]byte, len(groups))
	for g, gr := range groups {
		firsts[g] = keys[gr.idx[0]]
	}
	mounts, paths, errs, err := e.nm.names(ctx, ns, firsts)
	if err != nil {
		failAll(todo, err)
		return nil, nil
	}
	now := e.cfg.Now().UnixNano()
	for g, gr := range groups {
		gr.mount, gr.path = mounts[g], paths[g]
		gr.hdr = ns.header(now)
		if m := e.mounts[gr.mount]; m.raw != nil {
			gr.hdr.Raw = true // a vllm-fs row: the payload alone
		} else if m.checksums {
			gr.hdr.Flags |= format.FlagPayloadSums
		}
		for _, i := range gr.idx {
			gr.hdr.Keys = append(gr.hdr.Keys, format.Key{Key: keys[i]})
		}
	}

	// Admission.
	admit := make([]bool, len(groups))
	if e.pol.Features().Has(abi.FeatureAdmit) {
		recs := make([]abi.AdmitRecord, 0, len(groups))
		for g, gr := range groups {
			if errs[g] == nil {
				recs = append(recs, abi.AdmitRecord{KeyHash: abi.KeyHash(firsts[g]), Size: uint64(gr.hdr.FileLen()), Time: uint64(now), NS: uint32(ns.id), Mount: uint32(gr.mount)})
			}
		}
		for start := 0; start < len(recs); start += abi.MaxBatch {
			if err := e.pol.Admit(ctx, recs[start:min(len(recs), start+abi.MaxBatch)]); err != nil {
				failAll(todo, fmt.Errorf("%w: admit: %w", ErrPolicy, err))
				return nil, nil
			}
		}
		r := 0
		for g, gr := range groups {
			if errs[g] == nil {
				admit[g] = recs[r].Admit != 0
				if admit[g] && recs[r].Target != recs[r].Mount { // admission chose another mount
					errs[g] = e.tier.retarget(ns, gr, recs[r].Target)
				}
				r++
			}
		}
	} else {
		for g := range admit {
			admit[g] = true
		}
	}

	var (
		wg       sync.WaitGroup
		deferred []int
		busy     []*flight
	)
	for g, gr := range groups {
		switch {
		case errs[g] != nil:
			failAll(gr.idx, errs[g])
			continue
		case !admit[g]:
			for _, i := range gr.idx {
				set(i, OutcomeNotAdmitted, nil)
			}
			continue
		case ctx.Err() != nil:
			failAll(gr.idx, ctx.Err())
			continue
		}
		claimed, old, fl := e.ix.Claim(gr.path)
		gr.old = old
		if !claimed {
			// Another job writes (or removes) this path: what it leaves
			// there decides, once it is done, which keys are stored.
			deferred = append(deferred, gr.idx...)
			busy = append(busy, fl)
			continue
		}
		if err := e.mv.slots.acquire(ctx); err != nil {
			e.rm.release(gr.path)
			failAll(gr.idx, err)
			continue
		}
		e.mv.slots.storeBegan()
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer e.releaseSlot()
			defer e.mv.slots.storeEnded() // before the slot: a store waiting for room re-counts the stores
			defer func() {
				if !gr.released {
					e.rm.release(gr.path)
				}
			}()
			if e.shared.heldAt(ctx, ns.fp, keys[gr.idx[0]], gr.old) {
				gr.held = true
				return
			}
			if err := e.replacing(gr.path, gr.old); err != nil {
				failAll(gr.idx, err)
				return
			}
			if err := e.storeFile(ctx, j, c, blocks, gr); err != nil {
				failAll(gr.idx, err)
				return
			}
			for _, i := range gr.idx {
				set(i, OutcomeStored, nil)
			}
		}()
	}
	wg.Wait()
	for _, gr := range groups {
		if gr.held {
			// Its first key is present; the next round says so and groups
			// the other keys afresh.
			deferred = append(deferred, gr.idx...)
		}
	}
	return deferred, busy
}

// replacing marks the store holding path as one that replaces old, the
// file indexed there (nil: none), so that no pin takes hold of old from
// then on (Pin), unless a client pin already holds old: a pinned file is
// never removed, so the store is refused. Both in one hold of index.mu: a
// pin either comes first and refuses the store, or finds the path being
// replaced and pins nothing.
func (e *Engine) replacing(path string, old *entry) error {
	if old == nil {
		return nil
	}
	if !e.ix.Flights().Replacing(path, old) {
		return fmt.Errorf("%w: it named file %s for these keys, which holds other keys a client pinned", ErrPolicy, path)
	}
	return nil
}

// storeFile writes one file: payload, then header (which carries the
// payload checksums), under a temporary name in the target directory, then
// publishes it by rename and indexes it.
func (e *Engine) storeFile(ctx context.Context, j *Job, c *cache, blocks [][]int, gr *group) (err error) {
	m := e.mounts[gr.mount]
	size := gr.hdr.FileLen()
	defer func() { e.watch.storeEnded(m, size, err) }()
	mv, err := m.mover(c.kind)
	if err != nil {
		return err
	}
	// A file of a whole group of keys is the size later stores most
	// likely write (a job's last file may hold fewer).
	full := len(gr.idx) >= c.ns.keysPerFile
	spare, err := e.capacity.reserveFile(ctx, m, c.ns.id, size, full)
	if err != nil {
		return err
	}
	// The file system may be fuller than the engine knows (other nodes,
	// other programs): an ENOSPC refreshes the capacity from statfs,
	// evicts down to it and tries once more.
	for attempt := 0; ; attempt++ {
		published, err := e.writeFile(ctx, j, c, blocks, gr, mv, spare)
		spare = spareFile{} // written, or removed
		if !published {
			if attempt == 0 && errors.Is(err, syscall.ENOSPC) && ctx.Err() == nil {
				e.cfg.Logger.Debug("engine: ENOSPC; evicting and trying again", "mount", m.root, "path", gr.path)
				e.capacity.reclaim(ctx, m, size)
				continue
			}
			e.capacity.unreserve(m, size)
		}
		return err
	}
}

// writeFile writes, publishes and indexes one file with mv, into spare
// where it is one (reserveFile); the caller holds the reservation. published says
// whether the reservation was consumed (the file was indexed, or published
// and removed again). Indexing the file also releases its path
// (gr.released).
func (e *Engine) writeFile(ctx context.Context, j *Job, c *cache, blocks [][]int, gr *group, mv transfer.Mover, spare spareFile) (published bool, err error) {
	m := e.mounts[gr.mount]
	h := gr.hdr
	size := h.FileLen()

	hl := int64(h.Len())
	if !mv.Checksums() {
		h.Flags &^= format.FlagPayloadSums // the file records it
	}
	h.LayerSums = nil // set with the payload sums, below
	// A store skips no block (request). Where the file will hold layer
	// sums (payload sums on, the table fits the header area), its
	// checksums are per layer of each key (layer-major) or per block's
	// layer (block-major), the layers' and keys' joined from them.
	by := verifyKeys
	if h.Flags&format.FlagPayloadSums != 0 && !h.Raw && h.LayerSumsFit() {
		by = verifyLayers
		if h.Order == format.OrderBlockMajor {
			by = verifyBlockLayers
		}
	}
	plan, ck := c.plan(h, nil, func(k int) []int { return blocks[gr.idx[k]] }, m, LayerRange{}, by)

	dir := filepath.Dir(gr.path)
	extra := 0
	if m.direct {
		extra = unix.O_DIRECT
	}
	f, tmp, op, err := e.own.openTemp(m, spare, dir, extra, size, hl+h.PayloadLen())
	if err != nil {
		return published, ioError(m, op, err)
	}
	defer func() {
		if !published {
			e.rm.removeTemp(m, tmp, f, size) // forgotten by the movers, then unlinked
		}
		if f != nil {
			f.Close()
		}
	}()
	var sums []uint32
	if h.Flags&format.FlagPayloadSums != 0 {
		sums = make([]uint32, plan.Sums)
	}
	io := e.busy.io.Begin()
	_, err = mv.WriteFile(ctx, f, plan, sums)
	e.busy.io.End(io)
	if err != nil {
		return published, ioError(m, "write", err)
	}
	if pad := size - hl - h.PayloadLen(); pad > 0 && !m.direct {
		// The file's zero tail (with O_DIRECT the mover writes it).
		if _, err := f.WriteAt(make([]byte, pad), hl+h.PayloadLen()); err != nil {
			return published, ioError(m, "write padding", err)
		}
	}
	if sums != nil {
		ck.stored(h, sums)
	}
	if !h.Raw { // a vllm-fs row has no header, hence no file id
		h.ID = fileID(e.mounts)
		hdr := fsys.AlignedBuffer(int(hl))
		if err := h.Encode(hdr); err != nil {
			return false, err
		}
		if _, err := f.WriteAt(hdr, 0); err != nil {
			return published, ioError(m, "write header", err)
		}
	}
	en := &entry{FP: h.Fingerprint, NS: uint32(c.ns.id), Mount: gr.mount, Path: gr.path, Size: size, FID: h.ID, Last: e.cfg.Now().UnixNano()}
	published, left, err := e.publish(ctx, m, f, tmp, en, gr.old, "")
	if published {
		f = nil // closed
	}
	switch {
	case err != nil && !published && (errors.Is(err, syscall.EISDIR) || errors.Is(err, syscall.ENOTEMPTY) || errors.Is(err, syscall.EEXIST)):
		return false, fmt.Errorf("%w: store on mount %s: %s is a directory, not a kvhost file: the policy's name for key %q collides with it", ErrPolicy, m.root, gr.path, h.Keys[0].Key)
	case err != nil && published:
		if left != nil {
			e.ix.Leaving().Leave(left, gr.path) // the reservation counts the file left
		} else {
			e.capacity.unreserve(m, size) // the file was removed again
		}
		if gr.old != nil {
			// The rename replaced the old file: it is gone, with any
			// keys of it this store did not write again.
			e.rm.drop(ctx, gr.old, false, "replaced by a store that failed after its rename")
		}
		return true, err
	case err != nil:
		return false, err
	}
	for _, k := range h.Keys {
		en.Keys = append(en.Keys, string(k.Key))
	}
	if sums != nil && transfer.SumsWritten(mv) {
		// The sums are of the bytes written (not of the source, read
		// again): a load may take them as verified while the file's
		// ctime stays the published one's.
		markChecked(m, en, h, en.Ident.Ctime, allKeys(h), LayerRange{})
	}
	// The path is released in the same step: what the insert replaced
	// is gr.old, forgotten before the rename.
	recs, fl, orphans := e.ix.PublishReleasing(en)
	gr.released = true
	e.rm.endRelease(gr.path, fl, orphans)
	e.access(ctx, recs)
	e.st.stores.Add(uint64(len(h.Keys)))
	e.st.written.Add(uint64(h.PayloadLen()))
	j.bytes.Add(h.PayloadLen())
	e.objs.published(h, gr.path, gr.toObjects)
	return true, nil
}
