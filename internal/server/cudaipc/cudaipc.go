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

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/protocol"
	"github.com/kvhost/kvhost/region"
)

// ErrClosed means the Importer was closed.
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
	// faults counts, per device, the registrations refused with a sticky
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

// Faults reports, per device ordinal, the registrations refused with a
// sticky CUDA error (an import's, or the probe's of a handle imported
// before): the daemon's context on the device is broken, which a
// registration may be the first to find (no job ran there since).
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
// *protocol.Error of code CodeUnsupported. On a device whose context a
// sticky error broke it fails with a *protocol.Error of code
// CodeInternal, counted in Faults, whether the handle is imported now or
// was before (a second region over one allocation makes no import call:
// the context is probed instead).
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
			return nil, im.refusal(ordinal, err)
		}
		sh = &shared{key: k, m: m, base: m.Ptr() - uintptr(offset), alloc: m.AllocSize}
		im.imports[k] = sh
	} else {
		if offset > sh.alloc || size > sh.alloc-offset {
			return nil, fmt.Errorf("cudaipc: %w: [%d, +%d) of a %d-byte allocation", region.ErrBounds, offset, size, sh.alloc)
		}
		// No driver call takes this path, so a context broken since the
		// import would accept the region: ask the device first.
		if err := im.probe(ctx, ordinal); err != nil {
			return nil, im.refusal(ordinal, err)
		}
	}
	sh.refs++
	im.live.Add(1)
	return &Memory{im: im, sh: sh, id: im.nextID.Add(1), ptr: sh.base + uintptr(offset), n: size}, nil
}

// refusal is Open's answer to a registration on device ordinal whose
// driver call (the import, or probe's query) failed with err. A sticky
// error counts as a fault of the device.
func (im *Importer) refusal(ordinal int, err error) error {
	switch {
	case errors.Is(err, cuda.ErrBounds):
		return fmt.Errorf("%w: %w", region.ErrBounds, err)
	case errors.Is(err, cuda.ErrSticky):
		im.faults[ordinal].Add(1)
		// Not the client's handle: the daemon's own context on the
		// device is broken (a "bad handle" answer would send the client
		// looking for a fault of its own). First: a range check that
		// failed on it is not the range's fault either.
		return &protocol.Error{Code: protocol.CodeInternal, Message: fmt.Sprintf("device %d: the daemon's CUDA context on this GPU is broken (a sticky error; the GPU may be lost) until the daemon restarts: %v", ordinal, err)}
	case errors.Is(err, cuda.ErrUnchecked):
		return &protocol.Error{Code: protocol.CodeUnsupported, Message: fmt.Sprintf("device %d: the range could not be checked against the exported allocation, so it is refused: %v", ordinal, err)}
	}
	return err
}

// probe asks whether the daemon's context on device ordinal still works,
// for a registration that makes no driver call of its own (its allocation
// is imported already). The call is cudaStreamQuery of the device
// worker's own stream: a query never waits (work still running answers
// "not ready"), and that stream is non-blocking and holds nothing, so the
// answer does not depend on the daemon's copies on other streams (the
// legacy default stream would be tied to blocking streams); yet a broken
// context answers it with its sticky error (CUDA documents that the call
// may return errors of earlier asynchronous launches). cudaGetLastError
// and cudaPeekAtLastError would not do: they return the last error of
// this thread's own runtime calls, and what breaks a context is a job on
// another thread. One call per registration: they are rare.
func (im *Importer) probe(ctx context.Context, ordinal int) error {
	return im.workers[ordinal].Do(ctx, func(w *cuda.Worker) error {
		_, err := im.rt.StreamDone(w.Stream())
		return err
	})
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
