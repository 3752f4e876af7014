package engine

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/region"
)

// Job is a store or load in progress.
type Job struct {
	id     JobID
	kind   string
	mem    region.Kind // the cache's memory (Config.Observer)
	done   chan struct{}
	cancel context.CancelFunc
	start  time.Time
	res    Result
	bytes  atomic.Int64
}

// ID returns the job's id.
func (j *Job) ID() JobID { return j.id }

// Done is closed when the job has finished.
func (j *Job) Done() <-chan struct{} { return j.done }

// Cancel asks the job to stop; keys not finished end OutcomeFailed with
// context.Canceled. Published files stay published.
func (j *Job) Cancel() { j.cancel() }

// Wait waits for the job and returns its result and Result.Err(), or ctx's
// error if ctx ends first (the job goes on).
func (j *Job) Wait(ctx context.Context) (Result, error) {
	select {
	case <-j.done:
		return j.res, j.res.Err()
	case <-ctx.Done():
		return Result{}, ctx.Err()
	}
}

// jobTable is the engine's jobs in flight. Its lock is apart from the
// engine's others and taken with none of them held: every store and load
// registers and ends a job, and on the engine's lock those two took a
// share of its traffic that made every other holder wait (RATIONALE,
// "Why do the jobs in flight have their own lock?").
type jobTable struct {
	mu     sync.Mutex
	jobs   map[JobID]*Job
	last   uint64
	closed bool           // Close began: no new job
	wg     sync.WaitGroup // one count per job in the table
}

// add registers a new job of kind with n keys, or fails with ErrClosed.
func (t *jobTable) add(kind string, n int, cancel context.CancelFunc) (*Job, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, ErrClosed
	}
	if t.jobs == nil {
		t.jobs = map[JobID]*Job{}
	}
	t.last++
	j := &Job{id: JobID(t.last), kind: kind, done: make(chan struct{}), cancel: cancel, start: time.Now()}
	j.res.Keys = make([]KeyResult, n)
	t.jobs[j.id] = j
	t.wg.Add(1)
	return j, nil
}

// remove unregisters j; the caller then calls t.wg.Done.
func (t *jobTable) remove(j *Job) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.jobs, j.id)
}

// close refuses new jobs: no wg.Add after it, so that wg.Wait may begin.
func (t *jobTable) close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
}

// cancelAll cancels every job in flight.
func (t *jobTable) cancelAll() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, j := range t.jobs {
		j.cancel()
	}
}

func (e *Engine) newJob(ctx context.Context, kind string, n int) (*Job, context.Context, error) {
	ctx, cancel := context.WithCancel(ctx)
	j, err := e.busy.jobs.add(kind, n, cancel)
	if err != nil {
		cancel()
		return nil, nil, err
	}
	return j, ctx, nil
}

func (e *Engine) finish(j *Job) {
	j.res.Bytes = j.bytes.Load()
	j.res.Duration = time.Since(j.start)
	for i, k := range j.res.Keys {
		if k.Outcome == OutcomePending {
			j.res.Keys[i] = KeyResult{Outcome: OutcomeFailed, Err: fmt.Errorf("engine: %s job %d: key not processed", j.kind, j.id)}
		}
		if j.res.Keys[i].Outcome == OutcomeFailed {
			e.st.failures.Add(1)
			e.st.fails.add(j.kind, j.res.Keys[i].Err, time.Now())
		}
	}
	e.busy.jobs.remove(j)
	e.st.ended.Add(1)
	e.observe(j)
	j.cancel()
	close(j.done)
	e.busy.jobs.wg.Done()
}

// Activity is what the data path is doing: enough for a watchdog to tell
// an engine that has stopped from a busy one.
type Activity struct {
	// Jobs is how many store and load jobs are in flight.
	Jobs int
	// Oldest is when the oldest of them began; zero with none.
	Oldest time.Time
	// OldestIO is when the oldest file operation in flight began (an
	// open, read, write, fsync, rename, close, remove or listing of the
	// engine's file system, or a mover's read or write of one file's
	// bytes); zero with none.
	OldestIO time.Time
	// Moved grows with every file stored or loaded (by its payload
	// bytes), evicted, demoted, promoted or moved between mounts, read by
	// a cluster adoption walk, and every job ended; its value means
	// nothing else.
	Moved uint64
}

// Activity reports the jobs in flight and how much the data path has
// moved so far.
func (e *Engine) Activity() Activity {
	a := Activity{
		Moved: e.st.written.Load() + e.st.read.Load() + e.st.evictions.Load() + e.st.ended.Load() + e.st.scanned.Load() +
			e.tier.moved(),
		OldestIO: e.busy.io.Oldest(),
	}
	e.busy.jobs.mu.Lock()
	defer e.busy.jobs.mu.Unlock()
	a.Jobs = len(e.busy.jobs.jobs)
	for _, j := range e.busy.jobs.jobs {
		if a.Oldest.IsZero() || j.start.Before(a.Oldest) {
			a.Oldest = j.start
		}
	}
	return a
}
