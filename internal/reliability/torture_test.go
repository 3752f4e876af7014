package reliability

import (
	"context"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/testsock"
)

// tortureParams size the SIGKILL torture.
type tortureParams struct {
	kills      int           // at least this many SIGKILLs
	acked      int           // and at least this many acknowledged keys
	clients    int           // concurrent storing clients
	keysPerJob int           // keys of one store job
	minRun     time.Duration // the daemon runs this long at least before a kill
	maxRun     time.Duration // and at most this long
}

func tortureSize() tortureParams {
	if long() {
		return tortureParams{kills: 100, acked: 100_000, clients: 4, keysPerJob: 16, minRun: 100 * time.Millisecond, maxRun: 1200 * time.Millisecond}
	}
	return tortureParams{kills: 10, acked: 2_000, clients: 4, keysPerJob: 16, minRun: 100 * time.Millisecond, maxRun: 800 * time.Millisecond}
}

// tortureCounts are the torture's results.
type tortureCounts struct {
	kills     int
	acked     int          // keys a store acknowledged (stored or present)
	unacked   atomic.Int64 // keys of store jobs the kill interrupted
	verified  atomic.Int64 // loads of acknowledged keys that matched byte for byte
	wrong     atomic.Int64 // loads that returned other bytes
	lost      atomic.Int64 // acknowledged keys a load reported missing
	failed    atomic.Int64 // acknowledged keys a load failed
	leftovers int          // temporary files found after a restart
}

func (c *tortureCounts) String() string {
	return fmt.Sprintf("torture: kills=%d acked=%d unacked=%d verified_loads=%d wrong_bytes=%d lost_acked=%d failed_loads=%d leftover_temp=%d",
		c.kills, c.acked, c.unacked.Load(), c.verified.Load(), c.wrong.Load(), c.lost.Load(), c.failed.Load(), c.leftovers)
}

// ackSet is the set of acknowledged keys, in acknowledgement order.
type ackSet struct {
	mu   sync.Mutex
	keys [][]byte
	bad  []string // examples of keys lost, failed or wrong
}

func (a *ackSet) add(k []byte) {
	a.mu.Lock()
	a.keys = append(a.keys, k)
	a.mu.Unlock()
}

func (a *ackSet) snapshot() [][]byte {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.keys[:len(a.keys):len(a.keys)]
}

func (a *ackSet) report(format string, args ...any) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.bad) < 20 {
		a.bad = append(a.bad, fmt.Sprintf(format, args...))
	}
}

// TestTortureSIGKILL stores keys from several clients while the daemon is
// SIGKILLed at random moments and restarted; after every restart no
// temporary file is left and every key a store acknowledged loads byte for
// byte, and so does every acknowledged key sampled during the run.
func TestTortureSIGKILL(t *testing.T) {
	p := tortureSize()
	rng := rand.New(rand.NewPCG(seed(t), 1))
	base := testsock.Dir(t)
	cfg := daemonConfig{
		Socket:      filepath.Join(base, "run", "kvhost.sock"),
		Mount:       filepath.Join(base, "cache"),
		Capacity:    "64GiB", // no eviction: every acknowledged key must stay
		KeysPerFile: 4,
	}
	var counts tortureCounts
	acks := &ackSet{}
	seqs := make([]int, p.clients) // next key number of each client
	ctx := context.Background()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Log(counts.String())
		t.Fatalf(format, args...)
	}
	for {
		d, err := tryStartDaemon(t, cfg)
		if err != nil {
			fail("restart after %d kills: %v", counts.kills, err)
		}
		if tmp := tempFiles(cfg.Mount); len(tmp) > 0 {
			counts.leftovers += len(tmp)
			acks.report("after kill %d: temporary files left: %v", counts.kills, tmp)
		}
		if err := verifyAcked(ctx, cfg.Socket, p.clients, acks, &counts); err != nil {
			fail("verifying after kill %d: %v; log:\n%s", counts.kills, err, d.log.tail(4000))
		}
		if counts.kills >= p.kills && len(acks.snapshot()) >= p.acked {
			// A clean stop leaves no temporary file; a start after it finds
			// every key.
			d.stop(t)
			if tmp := tempFiles(cfg.Mount); len(tmp) > 0 {
				counts.leftovers += len(tmp)
				acks.report("after SIGTERM: temporary files left: %v", tmp)
			}
			d = startDaemon(t, cfg)
			if err := verifyAcked(ctx, cfg.Socket, p.clients, acks, &counts); err != nil {
				fail("verifying after the clean restart: %v", err)
			}
			d.stop(t)
			break
		}
		// The workload runs until the kill, at a random moment.
		run := p.minRun + time.Duration(rng.Int64N(int64(p.maxRun-p.minRun)))
		wg := startTortureClients(ctx, cfg.Socket, p, seqs, rng, acks, &counts)
		<-time.After(run)
		d.kill()
		counts.kills++
		wg.Wait()
		if counts.kills%10 == 0 {
			t.Logf("after %d kills: %d acknowledged keys, %d verified loads", counts.kills, len(acks.snapshot()), counts.verified.Load())
		}
	}
	counts.acked = len(acks.snapshot())
	t.Log(counts.String())
	fmt.Println(counts.String())
	if counts.wrong.Load() > 0 || counts.lost.Load() > 0 || counts.failed.Load() > 0 || counts.leftovers > 0 {
		t.Fatalf("%s\nexamples:\n%v", counts.String(), acks.bad)
	}
	if counts.verified.Load() < int64(counts.acked) {
		t.Fatalf("only %d verified loads of %d acknowledged keys", counts.verified.Load(), counts.acked)
	}
}

// startTortureClients starts p.clients tortureClients on socket, each
// with its own sequence in seqs and a generator seeded from rng; the
// group is done when every one has returned.
func startTortureClients(ctx context.Context, socket string, p tortureParams, seqs []int, rng *rand.Rand, acks *ackSet, counts *tortureCounts) *sync.WaitGroup {
	var wg sync.WaitGroup
	for i := range p.clients {
		crng := rand.New(rand.NewPCG(rng.Uint64(), uint64(i)))
		wg.Add(1)
		go func() {
			defer wg.Done()
			tortureClient(ctx, socket, i, &seqs[i], p.keysPerJob, crng, acks, counts)
		}()
	}
	return &wg
}

// tortureClient stores jobs of fresh keys (client i, numbered from *seq)
// until the connection is lost, adding every acknowledged key to acks, and
// every fourth job loads a sample of acknowledged keys back.
func tortureClient(ctx context.Context, socket string, i int, seq *int, perJob int, rng *rand.Rand, acks *ackSet, counts *tortureCounts) {
	c, k, err := dialCache(ctx, socket, fmt.Sprintf("torture-%d", i), 4*perJob)
	if err != nil {
		return // killed before or during the set-up
	}
	defer k.close()
	defer c.Close()
	for job := 0; ; job++ {
		if !storeFresh(ctx, k, fmt.Sprintf("t%d", i), seq, perJob, acks, counts) {
			return
		}
		if job%4 != 3 {
			continue
		}
		all := acks.snapshot()
		if len(all) == 0 {
			continue
		}
		// Distinct keys: a key repeated in one load is another check
		// (TestLoadRepeatedKey).
		sample := make([][]byte, 0, perJob)
		picked := map[int]bool{}
		for len(sample) < min(perJob, len(all)) {
			if j := rng.IntN(len(all)); !picked[j] {
				picked[j] = true
				sample = append(sample, all[j])
			}
		}
		if !checkLoads(ctx, k, sample, acks, counts) {
			return
		}
	}
}

// storeFresh stores one job of perJob fresh keys (prefix-number, numbered
// from *seq), adding every acknowledged key to acks and counting the
// others as unacknowledged. It reports false when the connection was lost.
func storeFresh(ctx context.Context, k *kvCache, prefix string, seq *int, perJob int, acks *ackSet, counts *tortureCounts) bool {
	keys := make([][]byte, perJob)
	for j := range keys {
		keys[j] = fmt.Appendf(nil, "%s-%09d", prefix, *seq)
		*seq++
	}
	res, err := k.store(ctx, keys)
	if err != nil {
		counts.unacked.Add(int64(len(keys)))
		return false
	}
	for j, kr := range res.Keys {
		switch kr.Outcome {
		case client.OutcomeStored, client.OutcomePresent:
			acks.add(keys[j])
		default:
			counts.unacked.Add(1)
		}
	}
	return true
}

// verifyAcked loads every acknowledged key, spread over workers
// connections, and checks its bytes.
func verifyAcked(ctx context.Context, socket string, workers int, acks *ackSet, counts *tortureCounts) error {
	all := acks.snapshot()
	const batch = 64
	errs := make(chan error, workers)
	for w := range workers {
		go func() {
			c, k, err := dialCache(ctx, socket, fmt.Sprintf("verify-%d", w), 2*batch)
			if err != nil {
				errs <- err
				return
			}
			defer k.close()
			defer c.Close()
			for lo := w * batch; lo < len(all); lo += workers * batch {
				if !checkLoads(ctx, k, all[lo:min(lo+batch, len(all))], acks, counts) {
					errs <- fmt.Errorf("load failed: connection lost")
					return
				}
			}
			errs <- nil
		}()
	}
	var first error
	for range workers {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	return first
}

// checkLoads loads keys (all acknowledged) and counts what came back. It
// reports false when the connection was lost.
func checkLoads(ctx context.Context, k *kvCache, keys [][]byte, acks *ackSet, counts *tortureCounts) bool {
	r, err := k.load(ctx, keys)
	if err != nil {
		return false
	}
	for j, o := range r.outcomes {
		switch {
		case r.match[j]:
			counts.verified.Add(1)
		case o == client.OutcomeLoaded:
			counts.wrong.Add(1)
			acks.report("key %s: loaded bytes differ from its payload", keys[j])
		case o == client.OutcomeMissing:
			counts.lost.Add(1)
			acks.report("key %s: acknowledged, load says missing", keys[j])
		default:
			counts.failed.Add(1)
			acks.report("key %s: acknowledged, load outcome %v code %d: %s", keys[j], o, r.codes[j], r.message)
		}
	}
	return true
}
