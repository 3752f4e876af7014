package objstore

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// Mover returns the store's data mover (engine.Objects): it reads a plan
// from a File of the store's into host memory, every run of extents that
// are contiguous in the object at once, each split into parallel ranged
// GETs (File.ReadvAt) that write straight into the extents' memory; each
// extent is checksummed by the goroutine whose GET brought its last
// bytes, while other GETs are on the way, and the checksums are joined
// in plan order (crc32c.Extend). The CPU staging pipeline
// would read an object as it reads a file, one range of 256 KiB after the
// other.
func (s *Store) Mover() transfer.Mover { return mover{} }

// mover is the Store's transfer.Mover.
type mover struct{}

// Name names the path: "s3".
func (mover) Name() string { return "s3" }

// Checksums is true: the mover checksums what it reads.
func (mover) Checksums() bool { return true }

// WriteFile fails: objects are written by uploads of whole files.
func (mover) WriteFile(context.Context, fsys.File, *transfer.Plan, []uint32) (int64, error) {
	return 0, fmt.Errorf("%w: objects are written whole, by uploads", transfer.ErrUnsupported)
}

// ReadFile reads p's extents from f, a File of a Store, into their host
// memory, and their checksums into sums (when not nil).
func (mover) ReadFile(ctx context.Context, f fsys.File, p *transfer.Plan, sums []uint32) (int64, error) {
	of, ok := f.(*File)
	if !ok {
		return 0, fmt.Errorf("%w: the s3 mover reads objects, not %T", transfer.ErrUnsupported, f)
	}
	if sums != nil && len(sums) < p.Sums {
		return 0, fmt.Errorf("objstore: %d checksum slots for a plan of %d", len(sums), p.Sums)
	}
	if err := p.Check(); err != nil {
		return 0, fmt.Errorf("objstore: %w", err)
	}
	bufs := make([][]byte, len(p.Extents))
	for i, x := range p.Extents {
		a, ok := x.Region.(region.Addressable)
		if !ok {
			return 0, fmt.Errorf("%w: the s3 mover moves host memory; extent %d is in %s memory", transfer.ErrUnsupported, i, x.Region.Kind())
		}
		mem := a.Bytes()
		if mem == nil {
			return 0, fmt.Errorf("objstore: extent %d: %w", i, region.ErrClosed)
		}
		bufs[i] = mem[x.RegionOff : x.RegionOff+x.Len : x.RegionOff+x.Len]
	}
	// Runs of extents contiguous in the object, read at once.
	type run struct {
		first, last int
		want        int64
		n           int
		err         error
	}
	var runs []*run
	for i := 0; i < len(p.Extents); {
		r := &run{first: i, want: p.Extents[i].Len}
		end := p.Extents[i].FileOff + p.Extents[i].Len
		for i++; i < len(p.Extents) && p.Extents[i].FileOff == end; i++ {
			end += p.Extents[i].Len
			r.want += p.Extents[i].Len
		}
		r.last = i
		runs = append(runs, r)
	}
	// regs[i] is the CRC-32C register of extent i, computed by the
	// goroutine whose range brought its last bytes; left[i], its bytes
	// not landed yet.
	var regs []uint32
	var left []atomic.Int64
	if sums != nil {
		regs, left = make([]uint32, len(p.Extents)), make([]atomic.Int64, len(p.Extents))
		for i, x := range p.Extents {
			left[i].Store(x.Len)
		}
	}
	landed := func(r *run) func(at, n int64) {
		if sums == nil {
			return nil
		}
		xs := p.Extents[r.first:r.last] // in the object's order
		return func(at, n int64) {
			i := sort.Search(len(xs), func(i int) bool { return xs[i].FileOff+xs[i].Len > at })
			for ; i < len(xs) && xs[i].FileOff < at+n; i++ {
				x := xs[i]
				got := min(at+n, x.FileOff+x.Len) - max(at, x.FileOff)
				if left[r.first+i].Add(-got) == 0 && x.Sum >= 0 {
					regs[r.first+i] = crc32c.Register(bufs[r.first+i])
				}
			}
		}
	}
	var wg sync.WaitGroup
	for _, r := range runs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// A client that truncates the memory behind its region
			// fails this read, not the daemon.
			r.err = region.Guard(func() (err error) {
				r.n, err = of.readv(bufs[r.first:r.last], p.Extents[r.first].FileOff, landed(r))
				return err
			})
		}()
	}
	wg.Wait()
	var total int64
	for _, r := range runs {
		total += int64(r.n)
		if r.err != nil {
			return total, r.err
		}
		if int64(r.n) < r.want {
			return total, fmt.Errorf("%w: %s ends %d bytes into a run of %d at %d", transfer.ErrShortFile, of.name, r.n, r.want, p.Extents[r.first].FileOff)
		}
	}
	// Every extent landed whole: its register joins its checksum.
	for i, x := range p.Extents {
		if sums != nil && x.Sum >= 0 {
			sums[x.Sum] = crc32c.Extend(sums[x.Sum], regs[i], x.Len)
		}
	}
	return total, nil
}
