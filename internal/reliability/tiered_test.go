package reliability

import (
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/format"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/plugins"
)

// tieredTortureSize sizes the tiered SIGKILL torture: the bounded run adds
// about as much to `make test` as TestTortureSIGKILL.
func tieredTortureSize() tortureParams {
	if long() {
		return tortureParams{kills: 100, acked: 40_000, clients: 4, keysPerJob: 16, minRun: 100 * time.Millisecond, maxRun: 1200 * time.Millisecond}
	}
	return tortureParams{kills: 10, acked: 2_000, clients: 4, keysPerJob: 16, minRun: 100 * time.Millisecond, maxRun: 800 * time.Millisecond}
}

// tierCounts are what the tiered torture adds to tortureCounts, summed
// over the daemons it started.
type tierCounts struct {
	// The daemons' counters (Stats): files moved down, moved up, moves
	// that failed, demotions and evictions that deleted files.
	demotions, promotions, moveFailures, demotionDeletes, evictions uint64

	heldDemoted  int // files the restart hold pinned, demoted (the log)
	coldTemp     int // temporary files a kill left on the cold mount: demotions' copies
	onBothAtKill int // files a kill left at the same path on both mounts
	deduped      int // second copies the daemons' starts removed (their log)
	onBoth       int // keys in files on both mounts after a start (must be 0)
	overCapacity int // Stats read during the runs with a mount's used bytes over its capacity (must be 0)
	samples      int // Stats read during the runs
	accounting   int // starts whose mount stats disagreed with the files there
}

func (c *tierCounts) String() string {
	return fmt.Sprintf("tiered: demotions=%d promotions=%d move_failures=%d demotion_deletes=%d evictions=%d held_demoted=%d cold_temp_at_kill=%d on_both_at_kill=%d deduped_at_start=%d keys_on_both_after_start=%d accounting_mismatches=%d stats_samples=%d over_capacity=%d",
		c.demotions, c.promotions, c.moveFailures, c.demotionDeletes, c.evictions, c.heldDemoted, c.coldTemp, c.onBothAtKill, c.deduped, c.onBoth, c.accounting, c.samples, c.overCapacity)
}

// add adds the moves a daemon counted (its last Stats).
func (c *tierCounts) add(st client.Stats) {
	c.evictions += st.Evictions
	if t := st.Tiering; t != nil {
		c.demotions += t.Demotions
		c.promotions += t.Promotions
		c.moveFailures += t.MoveFailures
		c.demotionDeletes += t.DemotionDeletes
	}
}

// TestTortureSIGKILLTiered is TestTortureSIGKILL on a daemon with two
// mounts and the tiered policy: a hot mount of 2 MiB that demotes to a
// cold one of 1 GiB (which evicts nothing), every load of a cold key
// promoting it at the next tick (promote_hits = 1, a 50 ms tick), and a
// restart hold that cycles through none, 300 ms and 10 s from one start
// to the next (the stores after a start demote the held files to make
// room). Files move all the time, so the kills land in moves. Besides the
// single-mount torture's checks, after every start: no key is in files
// on both mounts (the copies a kill between a move's rename and its
// source's removal left; the start removes one), and each mount's used
// bytes and entries in Stats are the files there; over the run,
// demotions, promotions and demotions of held files happened, and no file
// was deleted.
func TestTortureSIGKILLTiered(t *testing.T) {
	if !slices.Contains(plugins.Names(), "tiered") {
		t.Fatalf("the kvhost binary embeds no tiered policy (it embeds %v): run `make wasm` first, as `make test` does", plugins.Names())
	}
	p := tieredTortureSize()
	rng := rand.New(rand.NewPCG(seed(t), 2))
	base := t.TempDir()
	hot, cold := filepath.Join(base, "hot"), filepath.Join(base, "cold")
	cfg := daemonConfig{
		Socket:       filepath.Join(base, "run", "kvhost.sock"),
		Mount:        hot,
		Capacity:     "2MiB",
		KeysPerFile:  4,
		Policy:       "tiered",
		PolicyParams: []string{"promote_hits = 1"},
		TickInterval: 50 * time.Millisecond,
		More:         []mountConfig{{Path: cold, Capacity: "1GiB"}}, // no eviction
		LogLevel:     "debug",                                       // the restart hold's demotions
	}
	holds := []string{"0s", "300ms", "10s"}
	maxKills := 5 * p.kills // the most kills spent waiting for moves of each kind
	var counts tortureCounts
	var tiers tierCounts
	acks := &ackSet{}
	seqs := make([]int, p.clients)
	ctx := context.Background()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Log(counts.String())
		t.Log(tiers.String())
		t.Fatalf(format, args...)
	}
	// started checks what a start found and left: temporary files, keys
	// on both mounts, and the mounts' accounting.
	started := func(d *daemon, when string) {
		t.Helper()
		tiers.deduped += strings.Count(d.log.String(), "second copy of a moved file removed")
		for _, dir := range []string{hot, cold} {
			if tmp := tempFiles(dir); len(tmp) > 0 {
				counts.leftovers += len(tmp)
				acks.report("%s: temporary files left: %v", when, tmp)
			}
		}
		hf, cf := walkTier(hot), walkTier(cold)
		for k := range hf.keys {
			if _, ok := cf.keys[k]; ok {
				tiers.onBoth++
				acks.report("%s: key %s is in %s and %s", when, k, hf.keys[k], cf.keys[k])
			}
		}
		if msg := settledAccounting(ctx, cfg.Socket, hot, cold); msg != "" {
			tiers.accounting++
			acks.report("%s: %s", when, msg)
		}
	}
	for {
		cfg.RestartHold = holds[counts.kills%len(holds)]
		tiers.coldTemp += len(tempFiles(cold)) // only moves write there
		tiers.onBothAtKill += samePaths(hot, cold)
		d, err := tryStartDaemon(t, cfg)
		if err != nil {
			fail("restart after %d kills: %v", counts.kills, err)
		}
		started(d, fmt.Sprintf("after kill %d (restart_hold %s)", counts.kills, cfg.RestartHold))
		if err := verifyAcked(ctx, cfg.Socket, p.clients, acks, &counts); err != nil {
			fail("verifying after kill %d: %v; log:\n%s", counts.kills, err, d.log.tail(4000))
		}
		// The run goes on past p.kills until it has moved files both ways
		// and demoted held ones, as a slower machine may need more kills
		// for that; tried reports whether it has.
		tried := tiers.demotions > 0 && tiers.promotions > 0 && tiers.heldDemoted > 0
		if counts.kills >= p.kills && len(acks.snapshot()) >= p.acked && (tried || counts.kills >= maxKills) {
			tiers.add(lastStats(ctx, cfg.Socket))
			d.stop(t)
			tiers.heldDemoted += heldDemotions(d.log.String())
			for _, dir := range []string{hot, cold} {
				if tmp := tempFiles(dir); len(tmp) > 0 {
					counts.leftovers += len(tmp)
					acks.report("after SIGTERM: temporary files left: %v", tmp)
				}
			}
			d = startDaemon(t, cfg)
			started(d, "after the clean restart")
			if err := verifyAcked(ctx, cfg.Socket, p.clients, acks, &counts); err != nil {
				fail("verifying after the clean restart: %v", err)
			}
			tiers.add(lastStats(ctx, cfg.Socket))
			d.stop(t)
			tiers.heldDemoted += heldDemotions(d.log.String())
			break
		}
		run := p.minRun + time.Duration(rng.Int64N(int64(p.maxRun-p.minRun)))
		wg := startTortureClients(ctx, cfg.Socket, p, seqs, rng, acks, &counts)
		// The daemon's counters die with it: the last ones read before the
		// kill are a lower bound of its moves.
		last := make(chan polled, 1)
		go func() { last <- pollStats(ctx, cfg.Socket) }()
		<-time.After(run)
		d.kill()
		counts.kills++
		wg.Wait()
		pl := <-last
		tiers.add(pl.last)
		tiers.samples += pl.samples
		tiers.overCapacity += pl.overCapacity
		tiers.heldDemoted += heldDemotions(d.log.String())
		if counts.kills%10 == 0 {
			t.Logf("after %d kills: %d acknowledged keys, %d verified loads; %s", counts.kills, len(acks.snapshot()), counts.verified.Load(), tiers.String())
		}
	}
	counts.acked = len(acks.snapshot())
	t.Log(counts.String())
	t.Log(tiers.String())
	fmt.Println(counts.String())
	fmt.Println(tiers.String())
	if counts.wrong.Load() > 0 || counts.lost.Load() > 0 || counts.failed.Load() > 0 || counts.leftovers > 0 || tiers.onBoth > 0 || tiers.accounting > 0 || tiers.overCapacity > 0 {
		t.Fatalf("%s\n%s\nexamples:\n%v", counts.String(), tiers.String(), acks.bad)
	}
	if counts.verified.Load() < int64(counts.acked) {
		t.Fatalf("only %d verified loads of %d acknowledged keys", counts.verified.Load(), counts.acked)
	}
	if tiers.demotions == 0 || tiers.promotions == 0 {
		t.Fatalf("no file moved both ways (%s): the torture tried nothing of tiering", tiers.String())
	}
	if tiers.heldDemoted == 0 {
		t.Fatalf("no file the restart hold pinned was demoted (%s): the torture tried nothing of the hold", tiers.String())
	}
	if tiers.demotionDeletes > 0 || tiers.evictions > 0 {
		t.Fatalf("files were deleted with 1 GiB free on the cold mount: %s", tiers.String())
	}
}

// heldDemotions sums the files of the daemon's log lines (JSON, debug
// level) that say files the restart hold pins were demoted.
func heldDemotions(log string) int {
	n := 0
	for _, line := range strings.Split(log, "\n") {
		if !strings.Contains(line, "files the restart hold pins demoted to make room") {
			continue
		}
		var rec struct{ Files int }
		if json.Unmarshal([]byte(line), &rec) == nil {
			n += rec.Files
		}
	}
	return n
}

// polled is what pollStats read.
type polled struct {
	last         client.Stats // the last Stats read
	samples      int          // Stats read
	overCapacity int          // of which with a mount's used bytes over its capacity
}

// pollStats reads the daemon's Stats until its connection is lost and
// returns the last ones read, counting those where a mount's used bytes
// passed its capacity.
func pollStats(ctx context.Context, socket string) polled {
	var p polled
	c, err := client.Dial(ctx, socket, "torture-stats")
	if err != nil {
		return p
	}
	defer c.Close()
	for {
		st, err := c.Stats(ctx)
		if err != nil {
			return p
		}
		p.last = st
		p.samples++
		for _, m := range st.Mounts {
			if m.Used > m.Capacity {
				p.overCapacity++
				break
			}
		}
		select {
		case <-ctx.Done():
			return p
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// lastStats reads the daemon's Stats once (zero where it cannot).
func lastStats(ctx context.Context, socket string) client.Stats {
	c, err := client.Dial(ctx, socket, "torture-stats")
	if err != nil {
		return client.Stats{}
	}
	defer c.Close()
	st, _ := c.Stats(ctx)
	return st
}

// tierFiles are the kvhost files under a mount.
type tierFiles struct {
	files int
	bytes int64
	keys  map[string]string // key -> the file holding it
}

// walkTier reads the header of every kvhost file under dir (names not
// starting with "."; files that vanish meanwhile are skipped, others that
// are not kvhost files counted too: the engine would count them nowhere).
func walkTier(dir string) tierFiles {
	tf := tierFiles{keys: map[string]string{}}
	walkFiles(dir, func(path string, f *os.File, h *format.Header) {
		fi, err := f.Stat()
		if err != nil {
			return
		}
		tf.files++
		tf.bytes += fi.Size()
		if h == nil {
			return
		}
		for _, k := range h.Keys {
			tf.keys[string(k.Key)] = path
		}
	})
	return tf
}

// samePaths counts the kvhost files (names not starting with ".") at the
// same relative path under both hot and cold.
func samePaths(hot, cold string) int {
	n := 0
	filepath.WalkDir(hot, func(path string, de fs.DirEntry, err error) error {
		if err != nil || !de.Type().IsRegular() || strings.HasPrefix(de.Name(), ".") {
			return nil
		}
		rel, err := filepath.Rel(hot, path)
		if err != nil {
			return nil
		}
		if _, err := os.Stat(filepath.Join(cold, rel)); err == nil {
			n++
		}
		return nil
	})
	return n
}

// settledAccounting compares the daemon's Stats of the mounts (used bytes,
// entries, keys) with the files there, until they agree (moves may be
// running) or 10 s pass; it returns the last difference, or "" where they
// agreed.
func settledAccounting(ctx context.Context, socket string, dirs ...string) string {
	c, err := client.Dial(ctx, socket, "torture-accounting")
	if err != nil {
		return fmt.Sprintf("stats: %v", err)
	}
	defer c.Close()
	var msg string
	waitFor(ctx, testwait.Hang, 50*time.Millisecond, func() bool {
		st, err := c.Stats(ctx)
		if err != nil {
			msg = fmt.Sprintf("stats: %v", err)
			return false
		}
		if len(st.Mounts) != len(dirs) {
			msg = fmt.Sprintf("stats has %d mounts, want %d", len(st.Mounts), len(dirs))
			return false
		}
		var diffs []string
		keys := 0
		for i, dir := range dirs {
			tf := walkTier(dir)
			keys += len(tf.keys)
			if m := st.Mounts[i]; m.Used != uint64(tf.bytes) || m.Entries != uint64(tf.files) {
				diffs = append(diffs, fmt.Sprintf("mount %d: stats say %d bytes in %d files, %s holds %d bytes in %d files", i, m.Used, m.Entries, dir, tf.bytes, tf.files))
			}
		}
		if st.Keys != uint64(keys) {
			diffs = append(diffs, fmt.Sprintf("stats say %d keys, the mounts hold %d", st.Keys, keys))
		}
		msg = strings.Join(diffs, "; ")
		return msg == ""
	})
	return msg
}
