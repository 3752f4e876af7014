package reliability

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/testsock"
)

// diskFullCounts are the disk-full scenario's results.
type diskFullCounts struct {
	attempted, stored, present, notAdmitted, failed atomic.Int64
	verified, wrong, evicted                        atomic.Int64 // reloads of stored keys
	served, unserved                                int64        // keys on disk loaded after the restart on a full file system
	failedCounted                                   uint64       // the daemon's failure counter
	failureLogs                                     int          // daemon log records about running out of space
	failCodes                                       sync.Map     // protocol code → *atomic.Int64
}

func (c *diskFullCounts) String() string {
	var codes []string
	c.failCodes.Range(func(k, v any) bool {
		codes = append(codes, fmt.Sprintf("%v:%d", k, v.(*atomic.Int64).Load()))
		return true
	})
	return fmt.Sprintf("disk-full: attempted=%d stored=%d present=%d not_admitted=%d failed=%d failed_codes=%v daemon_failures=%d failure_logs=%d verified_loads=%d wrong_bytes=%d evicted_before_reload=%d served_after_full_restart=%d unserved=%d",
		c.attempted.Load(), c.stored.Load(), c.present.Load(), c.notAdmitted.Load(), c.failed.Load(), codes, c.failedCounted, c.failureLogs,
		c.verified.Load(), c.wrong.Load(), c.evicted.Load(), c.served, c.unserved)
}

// fillStores stores n fresh keys named prefix-i from one client in jobs of
// 16 and loads every acknowledged key back at once, counting outcomes.
func fillStores(ctx context.Context, socket, prefix string, n int, counts *diskFullCounts) error {
	const perJob = 16
	c, k, err := dialCache(ctx, socket, prefix, 2*perJob)
	if err != nil {
		return err
	}
	defer k.close()
	defer c.Close()
	for lo := 0; lo < n; lo += perJob {
		var keys [][]byte
		for i := lo; i < min(lo+perJob, n); i++ {
			keys = append(keys, fmt.Appendf(nil, "%s-%07d", prefix, i))
		}
		res, err := k.store(ctx, keys)
		if err != nil {
			return fmt.Errorf("store: %w", err)
		}
		counts.attempted.Add(int64(len(keys)))
		var acked [][]byte
		for i, kr := range res.Keys {
			switch kr.Outcome {
			case client.OutcomeStored:
				counts.stored.Add(1)
				acked = append(acked, keys[i])
			case client.OutcomePresent:
				counts.present.Add(1)
				acked = append(acked, keys[i])
			case client.OutcomeNotAdmitted:
				counts.notAdmitted.Add(1)
			default:
				counts.failed.Add(1)
				v, _ := counts.failCodes.LoadOrStore(kr.Code, new(atomic.Int64))
				v.(*atomic.Int64).Add(1)
			}
		}
		if len(acked) == 0 {
			continue
		}
		r, err := k.load(ctx, acked)
		if err != nil {
			return fmt.Errorf("load: %w", err)
		}
		for i, o := range r.outcomes {
			switch {
			case r.match[i]:
				counts.verified.Add(1)
			case o == client.OutcomeLoaded:
				counts.wrong.Add(1)
			default: // evicted by a later store of this job's neighbours
				counts.evicted.Add(1)
			}
		}
	}
	return nil
}

// spaceLogs counts the daemon's log records that mention running out of
// space.
func spaceLogs(log string) int {
	n := 0
	for _, l := range strings.Split(log, "\n") {
		if strings.Contains(strings.ToLower(l), "space") {
			n++
		}
	}
	return n
}

// TestDiskFull runs the daemon on a 64 MiB tmpfs that holds 20 MiB of
// foreign data, with the capacity left to the daemon: stores must mostly
// succeed (the capacity is what the file system can hold, ENOSPC evicts
// and retries), each failure must be counted and logged, and no load may
// return a wrong byte. Then the file system is filled to 100% with the
// daemon stopped: the daemon must start, serve every key on disk, and
// either store or cleanly fail new keys.
func TestDiskFull(t *testing.T) {
	fsDir, err := mountTmpfs(t, 64)
	if err != nil {
		t.Skipf("the disk-full scenario needs a small file system of its own: %v", err)
	}
	if _, err := fillFile(filepath.Join(fsDir, "foreign-20MiB"), 20<<20); err != nil {
		t.Fatal(err)
	}
	cfg := daemonConfig{Socket: filepath.Join(testsock.Dir(t), "kvhost.sock"), Mount: filepath.Join(fsDir, "cache")}
	perClient := 8192 // 2 × 8,192 keys of 8 KiB files: twice the free space
	if long() {
		perClient = 32768
	}
	ctx := context.Background()
	var counts diskFullCounts
	defer func() { t.Log(counts.String()); fmt.Println(counts.String()) }()

	// Phase 1: 20 MiB of foreign data, stores beyond the free space.
	d := startDaemon(t, cfg)
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- fillStores(ctx, cfg.Socket, fmt.Sprintf("df%d", i), perClient, &counts)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("%v; log:\n%s", err, d.log.tail(4000))
		}
	}
	c, err := client.Dial(ctx, cfg.Socket, "stats")
	if err != nil {
		t.Fatal(err)
	}
	st, err := c.Stats(ctx)
	c.Close()
	if err != nil {
		t.Fatal(err)
	}
	counts.failedCounted = st.Failures
	counts.failureLogs = spaceLogs(d.log.String())
	if counts.wrong.Load() > 0 {
		t.Errorf("%d loads returned wrong bytes", counts.wrong.Load())
	}
	if f := counts.failed.Load(); f > 0 {
		if counts.failedCounted < uint64(f) {
			t.Errorf("%d stores failed, the daemon counted %d failures", f, counts.failedCounted)
		}
		if counts.failureLogs == 0 {
			t.Errorf("%d stores failed and the daemon logged nothing about space (log level info)", f)
		}
		if f > counts.attempted.Load()/10 {
			t.Errorf("%d of %d stores failed: the capacity does not follow the file system (ENOSPC must evict and retry)", f, counts.attempted.Load())
		}
	}

	// Phase 2: the file system 100% full, the daemon restarted.
	d.stop(t)
	if _, err := fillFile(filepath.Join(fsDir, "foreign-fill"), 0); err != nil {
		t.Fatal(err)
	}
	var sf unix.Statfs_t
	if err := unix.Statfs(fsDir, &sf); err == nil {
		t.Logf("file system filled: %d free blocks", sf.Bavail)
	}
	d, err = tryStartDaemon(t, cfg)
	if err != nil {
		t.Fatalf("the daemon does not start on a full file system: %v", err)
	}
	onDisk := scanFiles(cfg.Mount)
	var keys [][]byte
	for k := range onDisk {
		keys = append(keys, []byte(k))
	}
	c, k, err := dialCache(ctx, cfg.Socket, "full", 128)
	if err != nil {
		t.Fatal(err)
	}
	defer k.close()
	defer c.Close()
	for lo := 0; lo < len(keys); lo += 64 {
		r, err := k.load(ctx, keys[lo:min(lo+64, len(keys))])
		if err != nil {
			t.Fatal(err)
		}
		for i, o := range r.outcomes {
			switch {
			case r.match[i]:
				counts.served++
			case o == client.OutcomeLoaded:
				counts.wrong.Add(1)
			default:
				counts.unserved++
			}
		}
	}
	if counts.unserved > 0 || counts.wrong.Load() > 0 {
		t.Errorf("on a full file system: %d of %d keys on disk not served, %d wrong", counts.unserved, len(keys), counts.wrong.Load())
	}
	failedBefore := counts.failed.Load()
	if err := fillStores(ctx, cfg.Socket, "dfull", 512, &counts); err != nil {
		t.Fatal(err)
	}
	if counts.wrong.Load() > 0 {
		t.Errorf("%d loads returned wrong bytes", counts.wrong.Load())
	}
	if f := counts.failed.Load() - failedBefore; f > 0 && spaceLogs(d.log.String()) == 0 {
		t.Errorf("%d stores failed on the full file system and the daemon logged nothing about space", f)
	}
	d.stop(t)
}
