package engine

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/internal/region"
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

func (e *Engine) newJob(ctx context.Context, kind string, n int) (*Job, context.Context, error) {
	ctx, cancel := context.WithCancel(ctx)
	e.jobsMu.Lock()
	defer e.jobsMu.Unlock()
	if e.jobsClosed {
		cancel()
		return nil, nil, ErrClosed
	}
	e.lastJob++
	j := &Job{id: JobID(e.lastJob), kind: kind, done: make(chan struct{}), cancel: cancel, start: time.Now()}
	j.res.Keys = make([]KeyResult, n)
	e.jobs[j.id] = j
	e.jobsWG.Add(1)
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
			e.fails.add(j.kind, j.res.Keys[i].Err, time.Now())
		}
	}
	e.jobsMu.Lock()
	delete(e.jobs, j.id)
	e.jobsMu.Unlock()
	e.observe(j)
	j.cancel()
	close(j.done)
	e.jobsWG.Done()
}
