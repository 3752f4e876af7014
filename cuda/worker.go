package cuda

import (
	"context"

	"fmt"
	"runtime"
	"sync"
	"unsafe"
)

// Worker is a goroutine locked to its OS thread with a device made
// current once, running submitted functions in order: the building block
// for every caller of CUDA (current device and per-thread state are per OS
// thread). A Worker owns a non-blocking stream for its functions' use.
type Worker struct {
	r       *Runtime
	ordinal int
	stream  Stream
	fns     chan func(*Worker)
	done    chan struct{}

	mu     sync.RWMutex
	closed bool
}

// NewWorker starts a worker on device ordinal; it fails if the device
// cannot be made current or the stream cannot be created.
func (r *Runtime) NewWorker(ordinal int) (*Worker, error) {
	w := &Worker{r: r, ordinal: ordinal, fns: make(chan func(*Worker)), done: make(chan struct{})}
	started := make(chan error, 1)
	go w.loop(started)
	if err := <-started; err != nil {
		return nil, err
	}
	return w, nil
}

func (w *Worker) loop(started chan<- error) {
	runtime.LockOSThread()
	// Stay locked: a thread whose CUDA state was changed is not handed back.
	defer close(w.done)
	if err := w.r.SetDevice(w.ordinal); err != nil {
		started <- fmt.Errorf("cuda: worker on device %d: %w", w.ordinal, err)
		return
	}
	s, err := w.r.NewStream()
	if err != nil {
		started <- fmt.Errorf("cuda: worker on device %d: %w", w.ordinal, err)
		return
	}
	w.stream = s
	started <- nil
	for fn := range w.fns {
		fn(w)
	}
	w.r.DestroyStream(s)
}

// Runtime is the worker's runtime.
func (w *Worker) Runtime() *Runtime { return w.r }

// Ordinal is the worker's device.
func (w *Worker) Ordinal() int { return w.ordinal }

// Stream is the worker's stream; use it only inside submitted functions.
func (w *Worker) Stream() Stream { return w.stream }

// Go queues fn to run on the worker's thread and returns at once after
// queuing (it waits for the worker to take fn, or for ctx).
func (w *Worker) Go(ctx context.Context, fn func(*Worker)) error {
	w.mu.RLock()
	defer w.mu.RUnlock()
	if w.closed {
		return ErrClosed
	}
	select {
	case w.fns <- fn:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Do runs fn on the worker's thread and returns its error.
func (w *Worker) Do(ctx context.Context, fn func(*Worker) error) error {
	res := make(chan error, 1)
	if err := w.Go(ctx, func(w *Worker) { res <- fn(w) }); err != nil {
		return err
	}
	return <-res // fn runs to completion once taken
}

// Close stops the worker after the functions already taken and destroys
// its stream. Go and Do fail with ErrClosed afterwards.
func (w *Worker) Close() error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return ErrClosed
	}
	w.closed = true
	close(w.fns)
	w.mu.Unlock()
	<-w.done
	return nil
}

// LockDevice locks the calling goroutine to its OS thread and makes device
// ordinal current there, for a goroutine that calls CUDA itself for a
// while (a job driving its own stream) rather than through a Worker.
// unlock releases the lock taken here and gives the thread back its
// previous context: the previous device current again (so a caller
// already locked to a thread, such as a Worker's function, keeps its
// device), or, on a thread that had no context current, none (with the
// driver API; without it, the device cudaGetDevice answered, 0 on such a
// thread, whose context that makes). The runtime's per-thread device then
// stays ordinal, which makes nothing: whoever calls CUDA on the thread
// next sets its own device first, as this package's rule says.
func (r *Runtime) LockDevice(ordinal int) (unlock func(), err error) {
	runtime.LockOSThread()
	prev, perr := r.Device()
	// cudaGetDevice answers 0 on a thread without a context: making device
	// 0 current again would make its primary context, GPU memory on a
	// device the caller may never use. The driver tells.
	var ctx uintptr
	none := r.fn.cuCtxGetCurrent != nil && callP(r.fn.cuCtxGetCurrent, unsafe.Pointer(&ctx)) == 0 && ctx == 0
	if err := r.SetDevice(ordinal); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("cuda: device %d: %w", ordinal, err)
	}
	return func() {
		switch {
		case none:
			callU(r.fn.cuCtxSetCurrent, 0)
		case perr == nil && prev != ordinal:
			r.SetDevice(prev)
		}
		runtime.UnlockOSThread()
	}, nil
}
