package reliability

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
)

// A slow or stalled link to the endpoint, made in user space: the
// kernel here has no netem qdisc (tc qdisc add ... netem: "Specified
// qdisc kind is unknown"), so a relay on the veth pair's host end holds
// back what it forwards.

// linkState is how a slowRelay forwards: each chunk no earlier than
// delay after it arrived, at most rate bytes a second over every
// connection and both ways (0: no bound), or nothing while stalled
// (connections stay open, packets stay queued: a partition that refuses
// nothing).
type linkState struct {
	delay   time.Duration
	rate    int
	stalled bool
}

// slowRelay is relay with a link whose state the test sets as it runs.
type slowRelay struct {
	addr    string
	mu      sync.Mutex
	state   linkState
	changed chan struct{} // closed and replaced at every set
	free    time.Time     // when the link has sent what it took (rate)
	done    chan struct{} // closed when the test ends
}

// newSlowRelay forwards every TCP connection accepted on host (port
// chosen) to target until the test ends, both ways through the link.
func newSlowRelay(t *testing.T, host, target string) *slowRelay {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	r := &slowRelay{addr: l.Addr().String(), changed: make(chan struct{}), done: make(chan struct{})}
	var mu sync.Mutex
	var conns []net.Conn
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, u)
			mu.Unlock()
			wg.Add(2)
			go func() { defer wg.Done(); r.pipe(u, c); u.Close() }()
			go func() { defer wg.Done(); r.pipe(c, u); c.Close() }()
		}
	}()
	t.Cleanup(func() {
		close(r.done)
		l.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return r
}

// set makes s the link's state from now on, for what is queued too.
func (r *slowRelay) set(s linkState) {
	r.mu.Lock()
	r.state = s
	close(r.changed)
	r.changed = make(chan struct{})
	r.mu.Unlock()
}

// take takes n bytes' time on the link at s.rate, after what it took
// before, and returns how long they wait for it.
func (r *slowRelay) take(n int, s linkState) time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	r.free = now.Add(max(0, r.free.Sub(now))).Add(time.Duration(n) * time.Second / time.Duration(s.rate))
	return r.free.Sub(now)
}

// get returns the link's state and the channel its next change closes.
func (r *slowRelay) get() (linkState, <-chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.state, r.changed
}

// chunk is what a pipe read, and when.
type chunk struct {
	b  []byte
	at time.Time
}

// pipe copies from src to dst through the link until either fails or
// the test ends.
func (r *slowRelay) pipe(dst, src net.Conn) {
	q := make(chan chunk, 256)
	go func() {
		defer close(q)
		for {
			b := make([]byte, 4096)
			n, err := src.Read(b)
			if n > 0 {
				select {
				case q <- chunk{b[:n], time.Now()}:
				case <-r.done:
					return
				}
			}
			if err != nil {
				return
			}
		}
	}()
	for c := range q {
		for len(c.b) > 0 {
			s, changed := r.get()
			var wait time.Duration
			piece := len(c.b)
			switch {
			case s.stalled:
				wait = -1
			case time.Until(c.at.Add(s.delay)) > 0:
				wait = time.Until(c.at.Add(s.delay))
			case s.rate > 0:
				// Pieces of a twentieth of a second's bytes, each
				// waiting for its time on the link.
				piece = min(piece, max(1, s.rate/20))
			}
			if wait != 0 && !r.sleep(wait, changed) {
				return
			}
			if wait != 0 {
				continue // the state may have changed meanwhile
			}
			if s.rate > 0 {
				if !r.sleep(r.take(piece, s), changed) {
					return
				}
				if now, _ := r.get(); now.stalled {
					continue
				}
			}
			if _, err := dst.Write(c.b[:piece]); err != nil {
				return
			}
			c.b = c.b[piece:]
		}
	}
}

// sleep waits d (forever where negative), or until the link's state
// changes; false where the test ended.
func (r *slowRelay) sleep(d time.Duration, changed <-chan struct{}) bool {
	var tc <-chan time.Time
	if d >= 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		tc = t.C
	}
	select {
	case <-tc:
	case <-changed:
	case <-r.done:
		return false
	}
	return true
}

// TestObjectsSlowLinkLoadsInTimeOrFailNamingTheObject: a daemon in a
// network namespace of its own reaches the bucket through a link that
// turns slow, starved, stalled and back (a relay in user space, as no
// netem qdisc is here), while another daemon stores the keys through a
// link of its own, and reads each object (8 KiB) in 4 ranged GETs, 2 at
// a time. A slow link (100 ms each way, 1 MB/s) loads every key with its
// bytes; one that cannot carry an object within the request timeout
// (1 KiB/s) and one that carries nothing
// (its connections open, a partition that refuses nothing) fail the key
// within its bound, twice the request timeout, with a message naming the
// GET of its object; with the link back every key loads again. Not one
// key loads with other bytes.
func TestObjectsSlowLinkLoadsInTimeOrFailNamingTheObject(t *testing.T) {
	p := newNetnsPair(t, "slow")
	const timeout = 2 * time.Second
	bound := 2 * timeout
	link := newSlowRelay(t, p.b.hostIP, p.ep.Host)
	a := startDaemon(t, p.config(t, "a", p.a, relay(t, p.a.hostIP, p.ep.Host), timeout))
	cb := p.config(t, "b", p.b, link.addr, timeout)
	cb.Extra += "range_size = \"2KiB\"\n" // an object in 4 GETs, 2 at a time
	b := startDaemon(t, cb)
	nodes := dialNodes(t, []*daemon{a, b}, "slow", 8)
	ctx := context.Background()
	keys := storeAndShare(t, nodes, "slow", 4)

	var wrong, loaded, failed int
	// load loads key on daemon b, one key a load, and returns its
	// outcome, message and time; a key loaded with other bytes counts
	// in wrong.
	load := func(key []byte) (client.Outcome, string, time.Duration) {
		t.Helper()
		start := time.Now()
		r, err := nodes[1].k.load(ctx, [][]byte{key})
		took := time.Since(start)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case r.outcomes[0] == client.OutcomeLoaded && !r.match[0]:
			wrong++
			t.Errorf("%s loaded with other bytes", key)
		case r.outcomes[0] == client.OutcomeLoaded:
			loaded++
		case r.outcomes[0] == client.OutcomeFailed:
			failed++
		}
		return r.outcomes[0], r.message, took
	}
	var report []string
	for _, phase := range []struct {
		name  string
		state linkState
		loads bool // every key loads; else every key fails within bound
	}{
		{"slow", linkState{delay: 100 * time.Millisecond, rate: 1 << 20}, true},
		{"starved", linkState{delay: 100 * time.Millisecond, rate: 1 << 10}, false},
		{"stalled", linkState{stalled: true}, false},
	} {
		link.set(phase.state)
		var longest time.Duration
		for _, k := range keys {
			out, msg, took := load(k)
			longest = max(longest, took)
			switch {
			case phase.loads && out != client.OutcomeLoaded:
				t.Errorf("%s link: load of %s: %v (%s), want it loaded", phase.name, k, out, msg)
			case !phase.loads && out != client.OutcomeFailed:
				t.Errorf("%s link: load of %s: %v, want failed", phase.name, k, out)
			case !phase.loads && (!strings.Contains(msg, "objstore: get") || !strings.Contains(msg, fmt.Sprintf("%x", k))):
				t.Errorf("%s link: the failed load's message %q names no GET of the key's object", phase.name, msg)
			}
			if took > bound {
				t.Errorf("%s link: load of %s took %v, past its bound %v", phase.name, k, took, bound)
			}
		}
		report = append(report, fmt.Sprintf("%s: longest load %v", phase.name, longest.Round(time.Millisecond)))
	}
	link.set(linkState{})
	for _, k := range keys {
		if !waitFor(ctx, time.Minute, 100*time.Millisecond, func() bool {
			out, _, _ := load(k)
			return out == client.OutcomeLoaded
		}) {
			t.Errorf("%s does not load again within a minute of the link's return", k)
		}
	}
	if wrong > 0 {
		t.Errorf("%d loads with other bytes", wrong)
	}
	t.Logf("slow link: keys=%d loaded=%d failed=%d wrong_bytes=%d; %s (request timeout %v, bound %v)", len(keys), loaded, failed, wrong, strings.Join(report, ", "), timeout, bound)
}
