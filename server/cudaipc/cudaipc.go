// Package cudaipc imports clients' GPU memory for the daemon: it is the
// server.Config.OpenDevice of a daemon with a CUDA runtime. Every import
// and every close runs on a thread locked to a worker whose current
// device is the memory's (CUDA's current device is per OS thread), one
// worker per device.
//
// Package server does not import it (nor CUDA): the daemon's main wires
// Importer.Open into server.Config.
package cudaipc

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvhost/kvhost/internal/cuda"
	"github.com/kvhost/kvhost/protocol"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/server"
)

// ErrClosed: the Importer was closed.
var ErrClosed = errors.New("cudaipc: importer closed")

// Importer imports CUDA IPC handles on the devices of one runtime.
//
// One allocation is imported once per device however many regions name
// it (the layers of a KV cache are often views of one allocation, so
// their handles are equal): the driver maps a handle once per context,
// and a second cudaIpcOpenMemHandle of the same handle is not portable.
// Each region is a range of the shared import, which is closed when the
// last region over it is.
type Importer struct {
	rt      *cuda.Runtime
	workers []*cuda.Worker
	live    atomic.Int64 // regions not yet closed
	nextID  atomic.Uint64
	// faults counts, per device, the imports that failed with a sticky
	// CUDA error: the daemon's context there is broken (Faults).
	faults []atomic.Uint64

	mu      sync.Mutex // guards imports and closed
	imports map[importKey]*shared
	closed  bool
}

type importKey struct {
	ordinal int
	handle  [protocol.CUDAIPCHandleLen]byte
}

// shared is one driver import and the regions over it.
type shared struct {
	key   importKey
	m     *cuda.IPCMemory
	base  uintptr // the allocation's first byte in this process
	alloc int64   // the allocation's size (the driver's, when it says)
	refs  int
}

// New starts an Importer for devices 0..devices-1 of rt; devices 0 means
// every device the runtime sees.
func New(rt *cuda.Runtime, devices int) (*Importer, error) {
	n, err := rt.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("cudaipc: %w", err)
	}
	if devices == 0 {
		devices = n
	}
	if devices <= 0 || devices > n {
		return nil, fmt.Errorf("cudaipc: %d devices asked for, the runtime sees %d", devices, n)
	}
	im := &Importer{rt: rt, imports: make(map[importKey]*shared), faults: make([]atomic.Uint64, devices)}
	for d := range devices {
		w, err := rt.NewWorker(d)
		if err != nil {
			im.Close()
			return nil, fmt.Errorf("cudaipc: %w", err)
		}
		im.workers = append(im.workers, w)
	}
	return im, nil
}

// Devices is the number of devices the Importer serves (server.Config.Devices).
func (im *Importer) Devices() int { return len(im.workers) }

// Faults reports, per device ordinal, the imports that failed with a
// sticky CUDA error: the daemon's context on the device is broken, which
// an import may be the first to find (no job ran there since).
func (im *Importer) Faults() map[int]uint64 {
	out := make(map[int]uint64, len(im.faults))
	for d := range im.faults {
		out[d] = im.faults[d].Load()
	}
	return out
}

// Live is the number of regions Open returned and not yet closed.
func (im *Importer) Live() int { return int(im.live.Load()) }

// Imports is the number of allocations imported from the driver now.
func (im *Importer) Imports() int {
	im.mu.Lock()
	defer im.mu.Unlock()
	return len(im.imports)
}

// Open imports [offset, offset+size) of the allocation handle names, on
// device ordinal: a server.Config.OpenDevice. A range the driver says lies
// outside the exported allocation fails with an error wrapping
// region.ErrBounds; a stale or forged handle, or another device's, with
// the CUDA error; a range the driver cannot check (no driver API) with a
// *protocol.Error of code CodeUnsupported.
func (im *Importer) Open(ctx context.Context, ordinal int, handle [protocol.CUDAIPCHandleLen]byte, offset, size int64) (server.DeviceMemory, error) {
	if ordinal < 0 || ordinal >= len(im.workers) {
		return nil, fmt.Errorf("cudaipc: device %d: serving 0..%d", ordinal, len(im.workers)-1)
	}
	if offset < 0 || size <= 0 || offset > (1<<63-1)-size {
		return nil, fmt.Errorf("cudaipc: %w: [%d, +%d)", region.ErrBounds, offset, size)
	}
	// Imports and closes of every device are serialised: they are rare
	// (registration time) and each is one driver call.
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.closed {
		return nil, ErrClosed
	}
	k := importKey{ordinal, handle}
	sh := im.imports[k]
	if sh == nil {
		var m *cuda.IPCMemory
		err := im.workers[ordinal].Do(ctx, func(w *cuda.Worker) error {
			var err error
			// The allocation must hold at least the range's end; the
			// driver's size is checked against that.
			m, err = im.rt.OpenIPC(w.Ordinal(), handle, offset, size, offset+size)
			return err
		})
		if err != nil {
			switch {
			case errors.Is(err, cuda.ErrBounds):
				return nil, fmt.Errorf("%w: %w", region.ErrBounds, err)
			case errors.Is(err, cuda.ErrSticky):
				im.faults[ordinal].Add(1)
				// Not the client's handle: the daemon's own context on the
				// device is broken (a "bad handle" answer would send the
				// client looking for a fault of its own). First: a range
				// check that failed on it is not the range's fault either.
				return nil, &protocol.Error{Code: protocol.CodeInternal, Message: fmt.Sprintf("device %d: the daemon's CUDA context on this GPU is broken (a sticky error; the GPU may be lost) until the daemon restarts: %v", ordinal, err)}
			case errors.Is(err, cuda.ErrUnchecked):
				return nil, &protocol.Error{Code: protocol.CodeUnsupported, Message: fmt.Sprintf("device %d: the range could not be checked against the exported allocation, so it is refused: %v", ordinal, err)}
			}
			return nil, err
		}
		sh = &shared{key: k, m: m, base: m.Ptr() - uintptr(offset), alloc: m.AllocSize}
		im.imports[k] = sh
	} else if offset > sh.alloc || size > sh.alloc-offset {
		return nil, fmt.Errorf("cudaipc: %w: [%d, +%d) of a %d-byte allocation", region.ErrBounds, offset, size, sh.alloc)
	}
	sh.refs++
	im.live.Add(1)
	return &Memory{im: im, sh: sh, id: im.nextID.Add(1), ptr: sh.base + uintptr(offset), n: size}, nil
}

// release drops a region of sh and closes the import with the last one.
func (im *Importer) release(sh *shared) error {
	im.mu.Lock()
	defer im.mu.Unlock()
	im.live.Add(-1)
	if sh.refs--; sh.refs > 0 {
		return nil
	}
	delete(im.imports, sh.key)
	if im.closed {
		return ErrClosed
	}
	return im.workers[sh.key.ordinal].Do(context.Background(), func(*cuda.Worker) error { return sh.m.Close() })
}

// Close stops the workers. Memory still imported can no longer be closed
// (the process is going away).
func (im *Importer) Close() error {
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.closed {
		return ErrClosed
	}
	im.closed = true
	for _, w := range im.workers {
		w.Close()
	}
	return nil
}

// Memory is a range of imported GPU memory, a region.Device. Its Close
// releases the range; the import goes with the last range over it
// (cudaIpcCloseMemHandle, on its device's worker).
type Memory struct {
	im   *Importer
	sh   *shared
	id   uint64
	ptr  uintptr
	n    int64
	once sync.Once
	err  error
}

// ID identifies the region within its Importer.
func (m *Memory) ID() uint64 { return m.id }

// Len is the range's length.
func (m *Memory) Len() int64 { return m.n }

// Kind is region.KindDevice.
func (m *Memory) Kind() region.Kind { return region.KindDevice }

// Ordinal is the device the memory lives on.
func (m *Memory) Ordinal() int { return m.sh.key.ordinal }

// Ptr is the address of the range's first byte in this process.
func (m *Memory) Ptr() uintptr { return m.ptr }

// AllocSize is the size of the allocation the range is in.
func (m *Memory) AllocSize() int64 { return m.sh.alloc }

// Close releases the range once; it may be called from any goroutine.
func (m *Memory) Close() error {
	m.once.Do(func() { m.err = m.im.release(m.sh) })
	return m.err
}

var _ server.DeviceMemory = (*Memory)(nil)
