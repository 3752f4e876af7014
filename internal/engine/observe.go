package engine

import (
	"slices"
	"strings"
	"time"

	"github.com/kvhost/kvhost/region"
)

// Observer is told about every finished store and load job (metrics).
// ObserveJob runs on the job's goroutine before the job is reported done,
// so that a caller that waited for a job sees it observed; it must be fast
// and safe for concurrent use.
type Observer interface {
	// ObserveJob receives the event of one finished job.
	ObserveJob(JobEvent)
}

// JobEvent describes one finished job.
type JobEvent struct {
	// Direction is "store" or "load".
	Direction string
	// Memory is the kind of memory the job's cache lives in.
	Memory region.Kind
	// Path names the data mover the job's files went through: the mover
	// of its memory kind on the mounts (e.g. "staging",
	// "cufile→gpu-staging"); mounts with different movers are joined by
	// ",".
	Path string
	// Bytes is the payload moved; Duration runs from submission to
	// completion.
	Bytes    int64
	Duration time.Duration // Result.Duration: from submission to completion
	// Outcomes counts the job's keys by outcome (indexed by Outcome).
	Outcomes [OutcomeFailed + 1]int
}

// observe reports a finished job to Config.Observer.
func (e *Engine) observe(j *Job) {
	if e.cfg.Observer == nil {
		return
	}
	path, ok := e.mv.paths[j.mem]
	if !ok {
		path = e.pathName(j.mem)
	}
	ev := JobEvent{Direction: j.kind, Memory: j.mem, Path: path, Bytes: j.res.Bytes, Duration: j.res.Duration}
	for _, k := range j.res.Keys {
		if int(k.Outcome) < len(ev.Outcomes) {
			ev.Outcomes[k.Outcome]++
		}
	}
	e.cfg.Observer.ObserveJob(ev)
}

// pathName names the movers of kind on the mounts (built at Open, never
// changed).
func (e *Engine) pathName(kind region.Kind) string {
	var names []string
	for _, m := range e.mounts {
		name := "none"
		if mv := m.movers[kind]; mv != nil {
			name = mv.Name()
		}
		if !slices.Contains(names, name) {
			names = append(names, name)
		}
	}
	return strings.Join(names, ",")
}

// StagingUsage reports the CPU staging pipeline's bounce buffers: in use
// now, the most that may exist (Config.StagingBytes), and their size.
func (e *Engine) StagingUsage() (inUse, limit, size int) {
	return e.mv.host.Buffers()
}
