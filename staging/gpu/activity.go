package gpu

import (
	"sync"
	"sync/atomic"
)

// activity counts a mover's jobs in flight and tells the idle registrars
// (files.runIdle) when the mover falls idle and when a job starts again.
// Its lock is taken twice a job, at the start and the end, so that the
// channels change only at the transitions between no job and some.
type activity struct {
	n    atomic.Int32 // jobs in flight; read without the lock
	mu   sync.Mutex
	idle chan struct{} // closed while no job runs
	busy chan struct{} // closed while a job runs
}

func newActivity() *activity {
	a := &activity{idle: make(chan struct{}), busy: make(chan struct{})}
	close(a.idle)
	return a
}

// begin counts a job starting.
func (a *activity) begin() {
	a.mu.Lock()
	if a.n.Add(1) == 1 {
		a.idle = make(chan struct{})
		close(a.busy)
	}
	a.mu.Unlock()
}

// end counts a job ending.
func (a *activity) end() {
	a.mu.Lock()
	if a.n.Add(-1) == 0 {
		a.busy = make(chan struct{})
		close(a.idle)
	}
	a.mu.Unlock()
}

// jobs is how many jobs are in flight.
func (a *activity) jobs() int32 { return a.n.Load() }

// signals returns a channel closed while no job runs (now or once the
// jobs in flight end) and one closed once a job runs.
func (a *activity) signals() (idle, busy <-chan struct{}) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.idle, a.busy
}
