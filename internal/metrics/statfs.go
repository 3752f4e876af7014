package metrics

import (
	"sync"
	"time"
)

// statfsWait is how long a scrape waits for the statfs calls it started
// (or found in flight) before it reports what the mounts last answered: a
// mount on a network file system that stopped answering (an NFS or FUSE
// server gone) blocks statfs without end, and a scrape must not.
const statfsWait = time.Second

// fsProbes reads the mounts' file systems (statfs) for the scrapes, with
// never more than one call in flight per mount: a scrape that finds one
// in flight waits for it (up to statfsWait) instead of starting another,
// so that a hung mount holds one goroutine and one thread, not one per
// scrape.
type fsProbes struct {
	mu sync.Mutex
	by map[string]*fsProbe // by mount path
}

// fsProbe is one mount's last answer and its call in flight; fsProbes.mu
// guards it.
type fsProbe struct {
	avail  int64         // bytes available, as last read
	at     time.Time     // when avail was read; zero: never, or the last call failed
	since  time.Time     // when the call in flight began; zero: none
	answer chan struct{} // closed when the call in flight returns; nil: none
}

// fsReading is what a scrape reports of one mount's file system.
type fsReading struct {
	avail   int64
	age     time.Duration // since avail was read
	ok      bool          // avail was read (the last call answered without error)
	pending time.Duration // how long the call in flight has gone unanswered; 0: none
}

// read returns a reading of each of paths, in order: it starts statfs
// where no call is in flight, then waits until they have all answered or
// statfsWait has passed, whichever comes first.
func (p *fsProbes) read(paths []string, statfs func(string) (int64, error)) []fsReading {
	waits := make([]chan struct{}, len(paths))
	p.mu.Lock()
	if p.by == nil {
		p.by = map[string]*fsProbe{}
	}
	for i, path := range paths {
		pr := p.by[path]
		if pr == nil {
			pr = &fsProbe{}
			p.by[path] = pr
		}
		if pr.answer == nil {
			pr.answer, pr.since = make(chan struct{}), time.Now()
			go p.call(pr, path, statfs)
		}
		waits[i] = pr.answer
	}
	p.mu.Unlock()
	timer := time.NewTimer(statfsWait)
	defer timer.Stop()
wait:
	for _, w := range waits {
		select {
		case <-w:
		case <-timer.C:
			break wait
		}
	}
	now := time.Now()
	out := make([]fsReading, len(paths))
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, path := range paths {
		pr := p.by[path]
		r := &out[i]
		if !pr.at.IsZero() {
			r.avail, r.age, r.ok = pr.avail, now.Sub(pr.at), true
		}
		if pr.answer != nil {
			r.pending = max(now.Sub(pr.since), time.Nanosecond)
		}
	}
	return out
}

// call runs statfs on path and records its answer in pr.
func (p *fsProbes) call(pr *fsProbe, path string, statfs func(string) (int64, error)) {
	avail, err := statfs(path)
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		pr.at = time.Time{}
	} else {
		pr.avail, pr.at = avail, time.Now()
	}
	close(pr.answer)
	pr.answer, pr.since = nil, time.Time{}
}
