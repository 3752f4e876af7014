package engine

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/transfer"
)

// The verification a load of a file (loadRound) and a load from the
// object mount (objectTier.load) share: the plan read with the bytes it
// leaves out that the checksums need, each key's checksum compared with
// its header's, and a failure judged by a private re-read.

// ofGeometry reports whether header h is of geometry g: its layers,
// planes, blocks per key and block size.
func ofGeometry(h *format.Header, g Geometry) bool {
	return h.Layers == uint32(g.Layers) && h.Planes == uint32(g.Planes()) &&
		h.BlocksPerKey == uint32(g.BlocksPerKey()) && h.BlockBytes == uint64(g.BlockBytes())
}

// readPlan moves plan from f through mv and, with sums (checksums
// verified), reads what the plan leaves out that the checksums need
// (checks.read); the reads count in flight in io.
func readPlan(ctx context.Context, mv transfer.Mover, f fsys.File, plan *transfer.Plan, sk *checks, sums []uint32, io *fsys.InFlight) error {
	t := io.Begin()
	defer io.End(t)
	_, err := mv.ReadFile(ctx, f, plan, sums)
	if err == nil && sums != nil {
		err = sk.read(ctx, f, sums)
	}
	return err
}

// verifyRead compares the checksums of the keys read (indices in h) of
// the source f, whose header is h, computed from their destination
// blocks (sums, through sk), with h's. It returns, indexed by the keys
// of h, why each key read failed (nil where it verified; errs is nil
// where every one did), and whether the source is corrupt. The blocks
// are the client's, which it may write during the load: only a private
// re-read of a key whose checksum failed (recheck) tells a corrupt
// source (ErrCorrupt) from blocks changed under the load
// (ErrDestinationChanged); a re-read that fails is the key's error. src
// names the source in the errors.
func verifyRead(ctx context.Context, f fsys.File, h *format.Header, sk *checks, sums []uint32, read []int, src string) (errs []error, corrupt bool) {
	var mismatched []bool // key -> its checksum failed
	var what []string     // key -> what failed, as loaded
	for _, k := range read {
		layer, got, want, mis := sk.mismatch(h, k, sums)
		if !mis {
			continue
		}
		if mismatched == nil {
			mismatched, what = make([]bool, len(h.Keys)), make([]string, len(h.Keys))
		}
		mismatched[k] = true
		what[k] = fmt.Sprintf("payload checksum 0x%08x, want 0x%08x", got, want)
		if layer >= 0 {
			what[k] = fmt.Sprintf("layer %d checksum 0x%08x, want 0x%08x", layer, got, want)
		}
	}
	if mismatched == nil {
		return nil, false
	}
	// It reads and checks whole keys (a key whose layer failed is
	// corrupt if the key is).
	private, err := recheck(ctx, f, h, mismatched)
	corrupt = errors.Is(err, ErrCorrupt)
	errs = make([]error, len(h.Keys))
	for k, mis := range mismatched {
		switch {
		case !mis:
		case err != nil:
			errs[k] = fmt.Errorf("engine: load %s: key %d: %s; re-reading: %w", src, k, what[k], err)
		case private[k] != h.Keys[k].Sum:
			corrupt = true
			errs[k] = fmt.Errorf("%w: %s: key %d: payload checksum 0x%08x, want 0x%08x", ErrCorrupt, src, k, private[k], h.Keys[k].Sum)
		default:
			errs[k] = fmt.Errorf("%w: %s: key %d", ErrDestinationChanged, src, k)
		}
	}
	return errs, corrupt
}

// loaded counts a key loaded into j with the layers lr: read bytes read
// from its source, moved of them into its blocks; byKey says a layer
// range was verified by the whole key's checksum (Stats.LayerLoadsByKey).
func (st *counters) loaded(j *Job, lr LayerRange, byKey bool, read, moved int64) {
	if lr.First == 0 {
		st.hits.Add(1) // one per layer-wise load of the key (runLoad)
	}
	st.loads.Add(1)
	if byKey && !lr.all() {
		st.layersByKey.Add(1)
	}
	// The bytes read: those loaded, and those read only to verify the
	// key; the job's bytes are those it loaded.
	st.read.Add(uint64(read))
	j.bytes.Add(moved)
}
