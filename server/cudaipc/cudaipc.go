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
type Importer struct {
	rt      *cuda.Runtime
	workers []*cuda.Worker
	live    atomic.Int64

	mu     sync.RWMutex
	closed bool
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
	im := &Importer{rt: rt}
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

// Live is the number of imports not yet closed.
func (im *Importer) Live() int { return int(im.live.Load()) }

// Open imports [offset, offset+size) of the allocation handle names, on
// device ordinal: a server.Config.OpenDevice. A range the driver says lies
// outside the exported allocation fails with an error wrapping
// region.ErrBounds; a stale or forged handle, or another device's, with
// the CUDA error.
func (im *Importer) Open(ctx context.Context, ordinal int, handle [protocol.CUDAIPCHandleLen]byte, offset, size int64) (server.DeviceMemory, error) {
	im.mu.RLock()
	defer im.mu.RUnlock()
	if im.closed {
		return nil, ErrClosed
	}
	if ordinal < 0 || ordinal >= len(im.workers) {
		return nil, fmt.Errorf("cudaipc: device %d: serving 0..%d", ordinal, len(im.workers)-1)
	}
	if offset < 0 || size <= 0 || offset > (1<<63-1)-size {
		return nil, fmt.Errorf("cudaipc: %w: [%d, +%d)", region.ErrBounds, offset, size)
	}
	w := im.workers[ordinal]
	var m *cuda.IPCMemory
	err := w.Do(ctx, func(w *cuda.Worker) error {
		var err error
		// The client names the range; the allocation must hold at least
		// its end, which the driver checks against the real size.
		m, err = im.rt.OpenIPC(w.Ordinal(), handle, offset, size, offset+size)
		return err
	})
	if err != nil {
		if errors.Is(err, cuda.ErrBounds) {
			return nil, fmt.Errorf("%w: %w", region.ErrBounds, err)
		}
		return nil, err
	}
	im.live.Add(1)
	return &Memory{IPCMemory: m, im: im, w: w}, nil
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

// Memory is imported GPU memory: a region.Device whose Close runs
// cudaIpcCloseMemHandle on its device's worker.
type Memory struct {
	*cuda.IPCMemory
	im   *Importer
	w    *cuda.Worker
	once sync.Once
	err  error
}

// Close releases the import once, on a thread whose current device is the
// memory's; it may be called from any goroutine.
func (m *Memory) Close() error {
	m.once.Do(func() {
		m.err = m.w.Do(context.Background(), func(*cuda.Worker) error { return m.IPCMemory.Close() })
		if m.err == nil || !errors.Is(m.err, cuda.ErrClosed) {
			m.im.live.Add(-1)
		}
	})
	return m.err
}

var _ server.DeviceMemory = (*Memory)(nil)
