package engine

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/format"
	"github.com/kvhost/kvhost/staging"
)

// Store stores keys from cache blocks, asynchronously. The request is
// validated at once; the returned Job reports, per key, stored, present, not
// admitted or failed. Consecutive keys are grouped into files of the
// namespace's KeysPerFile. Cancelling ctx cancels the job. The caller must
// not modify the blocks until the job is done.
func (e *Engine) Store(ctx context.Context, req StoreRequest) (*Job, error) {
	c, err := e.request(req.Cache, req.Keys, req.Blocks)
	if err != nil {
		return nil, err
	}
	keys, blocks := cloneRequest(req.Keys, req.Blocks)
	j, jctx, err := e.newJob(ctx, "store", len(keys))
	if err != nil {
		return nil, err
	}
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
}

func (e *Engine) runStore(ctx context.Context, j *Job, c *cache, keys [][]byte, blocks [][]int) {
	defer e.finish(j)
	ns := c.ns
	set := func(i int, o Outcome, err error) { j.res.Keys[i] = KeyResult{Outcome: o, Err: err} }
	failAll := func(idx []int, err error) {
		for _, i := range idx {
			set(i, OutcomeFailed, err)
		}
	}

	// Keys already stored (and still on disk), or repeated in the request.
	var todo []int
	seen := map[string]bool{}
	for i, k := range keys {
		if seen[string(k)] {
			set(i, OutcomePresent, nil)
			continue
		}
		seen[string(k)] = true
		if en := e.find(ns, k); en != nil && e.verify(ctx, en) {
			set(i, OutcomePresent, nil)
			continue
		}
		todo = append(todo, i)
	}
	if len(todo) == 0 {
		return
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
	mounts, paths, errs, err := e.names(ctx, ns, firsts)
	if err != nil {
		failAll(todo, err)
		return
	}
	now := e.now().UnixNano()
	for g, gr := range groups {
		gr.mount, gr.path = mounts[g], paths[g]
		gr.hdr = &format.Header{
			Fingerprint: ns.fp, Order: ns.order, Layers: uint32(ns.geo.Layers), Planes: uint32(ns.geo.Planes()),
			BlocksPerKey: uint32(ns.geo.BlocksPerKey()), BlockBytes: uint64(ns.geo.BlockBytes()), Created: now,
		}
		if !e.cfg.NoChecksum {
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
				return
			}
		}
		r := 0
		for g := range groups {
			if errs[g] == nil {
				admit[g] = recs[r].Admit != 0
				r++
			}
		}
	} else {
		for g := range admit {
			admit[g] = true
		}
	}

	var wg sync.WaitGroup
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
		e.mu.Lock()
		_, busy := e.inflight[gr.path]
		if !busy {
			e.inflight[gr.path] = struct{}{}
		}
		e.mu.Unlock()
		if busy {
			// The same file is being written by another job: one intact
			// file results either way.
			for _, i := range gr.idx {
				set(i, OutcomePresent, nil)
			}
			continue
		}
		wg.Add(1)
		gr := gr
		err := e.pool.Submit(ctx, func(w *staging.Worker) {
			defer wg.Done()
			defer e.release(gr.path)
			if err := e.storeFile(ctx, w, j, c, blocks, gr); err != nil {
				failAll(gr.idx, err)
				return
			}
			for _, i := range gr.idx {
				set(i, OutcomeStored, nil)
			}
		})
		if err != nil {
			wg.Done()
			e.release(gr.path)
			failAll(gr.idx, err)
		}
	}
	wg.Wait()
}

func (e *Engine) release(path string) {
	e.mu.Lock()
	delete(e.inflight, path)
	e.mu.Unlock()
}

// storeFile writes one file: payload, then header (which carries the
// payload checksums), under a temporary name in the target directory, then
// publishes it by rename and indexes it.
func (e *Engine) storeFile(ctx context.Context, w *staging.Worker, j *Job, c *cache, blocks [][]int, gr *group) (err error) {
	m := e.mounts[gr.mount]
	h := gr.hdr
	size := h.FileLen()
	if err := e.reserve(ctx, m, size); err != nil {
		return err
	}
	published := false
	defer func() {
		if !published {
			e.unreserve(m, size)
		}
	}()

	hl := int64(h.Len())
	spans := make([]staging.Span, 0, len(h.Keys)*int(h.Layers*h.Planes*h.BlocksPerKey)+1)
	h.Walk(nil, func(k, b, l, p int, off int64) {
		spans = append(spans, staging.Span{Off: hl + off, Buf: c.block(l, p, blocks[gr.idx[k]][b]), Sum: k})
	})
	if pad := size - hl - h.PayloadLen(); pad > 0 {
		spans = append(spans, staging.Span{Off: hl + h.PayloadLen(), Buf: staging.AlignedBuffer(int(pad)), Sum: -1})
	}

	dir := filepath.Dir(gr.path)
	tmp := filepath.Join(dir, fmt.Sprintf("%s%016x", tmpPrefix, rand.Uint64()))
	flag := os.O_WRONLY | os.O_CREATE | os.O_EXCL
	if m.direct {
		flag |= unix.O_DIRECT
	}
	if err := e.mkdir(dir, false); err != nil {
		return e.ioError(m, "mkdir", err)
	}
	f, err := e.fs.OpenFile(tmp, flag, 0o644)
	if errors.Is(err, os.ErrNotExist) { // the directory was removed behind our back
		if err = e.mkdir(dir, true); err == nil {
			f, err = e.fs.OpenFile(tmp, flag, 0o644)
		}
	}
	if err != nil {
		return e.ioError(m, "create", err)
	}
	defer func() {
		if f != nil {
			f.Close()
		}
		if !published {
			if rerr := e.fs.Remove(tmp); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
				e.log.Warn("engine: remove temporary file", "path", tmp, "err", rerr)
			}
		}
	}()
	if err := f.Allocate(size); err != nil {
		return e.ioError(m, "allocate", err)
	}
	var sums []uint32
	if !e.cfg.NoChecksum {
		sums = make([]uint32, len(h.Keys))
	}
	opt := staging.Options{Direct: m.direct, Sums: sums, Overlap: m.direct && !m.memory}
	if _, err := w.Write(ctx, f, spans, opt); err != nil {
		return e.ioError(m, "write", err)
	}
	for k := range h.Keys {
		if sums != nil {
			h.Keys[k].Sum = sums[k]
		}
	}
	hdr := staging.AlignedBuffer(int(hl))
	if err := h.Encode(hdr); err != nil {
		return err
	}
	if _, err := w.Write(ctx, f, []staging.Span{{Off: 0, Buf: hdr, Sum: -1}}, staging.Options{Direct: m.direct}); err != nil {
		return e.ioError(m, "write header", err)
	}
	if e.cfg.Fsync {
		if err := f.Sync(); err != nil {
			return e.ioError(m, "fsync", err)
		}
	}
	cerr := f.Close()
	f = nil
	if cerr != nil {
		return e.ioError(m, "close", cerr)
	}
	if err := e.fs.Rename(tmp, gr.path); err != nil {
		return e.ioError(m, "rename", err)
	}
	published = true // the temporary name is gone; the file is visible
	fi, err := e.fs.Stat(gr.path)
	if err == nil && e.cfg.Fsync {
		err = e.fs.SyncDir(dir)
	}
	if err != nil {
		// Visible but not indexed (or not durable): remove it rather than
		// report a store we cannot vouch for.
		e.fs.Remove(gr.path)
		e.unreserve(m, size)
		return e.ioError(m, "publish", err)
	}

	en := &entry{fp: h.Fingerprint, ns: c.ns.id, mount: gr.mount, path: gr.path, size: size, ino: inode(fi), last: e.now().UnixNano()}
	en.verified.Store(en.last)
	for _, k := range h.Keys {
		en.keys = append(en.keys, string(k.Key))
	}
	e.mu.Lock()
	m.used -= size // the reservation becomes the entry
	replaced := e.insertLocked(en)
	recs := make([]abi.AccessRecord, 0, len(replaced)+1)
	for _, r := range replaced {
		recs = append(recs, r.access(abi.AccessRemove, en.last))
	}
	recs = append(recs, en.access(abi.AccessInsert, en.last))
	e.mu.Unlock()
	e.access(ctx, recs)
	e.st.stores.Add(uint64(len(h.Keys)))
	e.st.written.Add(uint64(h.PayloadLen()))
	j.bytes.Add(h.PayloadLen())
	return nil
}

// ioError wraps a file-system error of a store; ENOSPC also wraps ErrNoSpace
// and names the mount.
func (e *Engine) ioError(m *mount, op string, err error) error {
	if errors.Is(err, syscall.ENOSPC) {
		return fmt.Errorf("%w: mount %s: %s: %w", ErrNoSpace, m.root, op, err)
	}
	return fmt.Errorf("engine: store on mount %s: %s: %w", m.root, op, err)
}

// mkdir creates dir (and parents) once; force re-creates it.
func (e *Engine) mkdir(dir string, force bool) error {
	if !force {
		if _, ok := e.dirs.Load(dir); ok {
			return nil
		}
	}
	if err := e.fs.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	e.dirs.Store(dir, struct{}{})
	return nil
}
