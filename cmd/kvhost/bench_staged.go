package main

import (
	"context"
	"errors"
	"fmt"
	"unsafe"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/internal/bench"
)

// gpuStager is one ceiling thread's device half of the staged ceilings
// (bench.Stager): a CUDA worker (its thread, with device 0 current, and
// its stream), device memory for the two slots of a chunk each, and an
// event per slot recorded after that slot's last copy.
type gpuStager struct {
	w       *cuda.Worker
	dev     *cuda.DeviceMemory
	events  [2]cuda.Event
	pending [2]bool // a copy was started on the slot and not waited for
	chunk   int64
}

// newGPUStager starts a worker on device 0 and allocates its device
// memory and events there.
func newGPUStager(ctx context.Context, rt *cuda.Runtime, chunk int64) (*gpuStager, error) {
	w, err := rt.NewWorker(0)
	if err != nil {
		return nil, fmt.Errorf("staged ceiling: %w", err)
	}
	s := &gpuStager{w: w, chunk: chunk}
	err = w.Do(ctx, func(w *cuda.Worker) error {
		r := w.Runtime()
		var err error
		if s.dev, err = r.Malloc(0, 2*chunk); err != nil {
			return err
		}
		for i := range s.events {
			if s.events[i], err = r.NewEvent(); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("staged ceiling: %w", errors.Join(err, s.close()))
	}
	return s, nil
}

// Do runs fn on the worker's thread.
func (s *gpuStager) Do(ctx context.Context, fn func() error) error {
	return s.w.Do(ctx, func(*cuda.Worker) error { return fn() })
}

// Start enqueues slot i's copy on the worker's stream and records the
// slot's event after it. A copy enqueued whose event could not be
// recorded is waited for here, so that Wait never returns while a copy
// of the slot may run.
func (s *gpuStager) Start(i int, p []byte, toDevice bool) error {
	if int64(len(p)) > s.chunk {
		return fmt.Errorf("staged ceiling: %d bytes in a %d-byte slot", len(p), s.chunk)
	}
	if len(p) == 0 {
		return nil
	}
	r, st := s.w.Runtime(), s.w.Stream()
	host, dev, n := uintptr(unsafe.Pointer(&p[0])), s.dev.Ptr()+uintptr(int64(i)*s.chunk), uintptr(len(p))
	var err error
	if toDevice {
		err = r.CopyH2D(dev, host, n, st)
	} else {
		err = r.CopyD2H(host, dev, n, st)
	}
	if err != nil {
		return err
	}
	if err := r.Record(s.events[i], st); err != nil {
		return errors.Join(err, r.Sync(st))
	}
	s.pending[i] = true
	return nil
}

// Wait waits for slot i's last copy.
func (s *gpuStager) Wait(i int) error {
	if !s.pending[i] {
		return nil
	}
	s.pending[i] = false
	return s.w.Runtime().Wait(s.events[i])
}

// close waits for the stream, frees what newGPUStager made and stops
// the worker.
func (s *gpuStager) close() error {
	err := s.w.Do(context.Background(), func(w *cuda.Worker) error {
		r := w.Runtime()
		err := r.Sync(w.Stream())
		for i, e := range s.events {
			if e != 0 {
				err = errors.Join(err, r.DestroyEvent(e))
				s.events[i] = 0
			}
		}
		if s.dev != nil {
			err = errors.Join(err, s.dev.Close())
			s.dev = nil
		}
		return err
	})
	return errors.Join(err, s.w.Close())
}

// stagers returns n stagers for chunks of chunk bytes, starting more
// when the ones held are too few (those held are kept: their chunk is
// the probe's, which does not change within a run).
func (r *benchRun) stagers(ctx context.Context, n int, chunk int64) ([]bench.Stager, error) {
	for len(r.staged) < n {
		s, err := newGPUStager(ctx, r.probe.Runtime(), chunk)
		if err != nil {
			return nil, err
		}
		r.staged = append(r.staged, s)
	}
	out := make([]bench.Stager, n)
	for i := range out {
		out[i] = r.staged[i]
	}
	return out, nil
}

// closeStagers stops every stager started.
func (r *benchRun) closeStagers() error {
	var err error
	for _, s := range r.staged {
		err = errors.Join(err, s.close())
	}
	r.staged = nil
	return err
}
