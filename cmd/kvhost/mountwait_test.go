package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/fsys/fsystest"
	"github.com/kvhost/kvhost/internal/config"
	kvdaemon "github.com/kvhost/kvhost/internal/daemon"
	"github.com/kvhost/kvhost/internal/testsock"
	"github.com/kvhost/kvhost/internal/testwait"
)

// TestServeRefusesToStartOnAMountWhoseStatfsDoesNotAnswer: a mount whose
// file system does not answer statfs (an NFS or FUSE server that stopped
// answering) held the daemon's start without end, in the engine's Open
// (or, without a configured capacity, in the statfs that sizes the
// mount). The start now gives it a bound and fails, with status 1 and an
// error naming the mount, whether or not a capacity is configured. The
// bound is the test's (server.statfs_timeout = "1ms"); the statfs is held
// until the test ends.
func TestServeRefusesToStartOnAMountWhoseStatfsDoesNotAnswer(t *testing.T) {
	for _, c := range []struct{ name, capacity string }{
		{"with a capacity", `capacity = "256MiB"`},
		{"without a capacity", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			socket := filepath.Join(testsock.Dir(t), "run", "kvhost.sock")
			mount := filepath.Join(dir, "blocks")
			file := filepath.Join(dir, "kvhost.toml")
			src := fmt.Sprintf("[server]\nsocket = %q\nstatfs_timeout = \"1ms\"\n\n[log]\nformat = \"json\"\n\n[policy]\ncache_dir = %q\n\n[[mount]]\npath = %q\n%s\n",
				socket, policyCache, mount, c.capacity)
			if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
				t.Fatal(err)
			}
			hold := &fsystest.Hold{}
			hold.Arm(fsys.OpStatfs)
			defer hold.Release() // the statfs left behind returns
			_, stderr, exit := runBackground(func(stdout, stderr io.Writer) int {
				return runServeWith(context.Background(), kvdaemon.Options{FS: &fsys.Faulty{FS: fsys.OS{}, Inj: hold}},
					[]string{"--config", file}, stdout, stderr)
			})
			code := awaitValue(t, "the start on a hung mount to end", exit)
			if !hold.Holding() {
				t.Fatalf("the start did not reach the mount's statfs (exit %d):\n%s", code, stderr)
			}
			msg := stoppedErr(t, []byte(stderr.String()))
			if code != 1 || !strings.Contains(msg, mount) || !strings.Contains(msg, "did not answer") {
				t.Fatalf("exit %d, error %q: want 1 and an error naming the mount %s that did not answer", code, msg, mount)
			}
		})
	}
}

// TestCheckFailsAMountWhoseStatfsDoesNotAnswer: `kvhost check` on a
// mount whose statfs does not answer hung. It now FAILs that mount (the
// daemon's start fails on it) once the bound has passed (the test's: a
// millisecond) and asks nothing more of it, and checks the other mounts.
func TestCheckFailsAMountWhoseStatfsDoesNotAnswer(t *testing.T) {
	hung, fine := t.TempDir(), t.TempDir()
	release := make(chan struct{})
	defer close(release) // the statfs left behind returns
	o := checkOptions{cfg: config.Default(), mountWait: heldOnly(hung), statfs: func(path string, st *unix.Statfs_t) error {
		if path == hung {
			<-release
		}
		return unix.Statfs(path, st)
	}}
	o.cfg.GPU.Mode, o.cfg.GPU.CuFile = "off", "off"
	o.cfg.Mounts = []config.Mount{{Path: hung}, {Path: fine}}
	checked := make(chan *checkReport, 1)
	go func() { checked <- doCheck(context.Background(), o) }()
	rep := awaitValue(t, "the check beside a hung mount to end", checked)
	var hungItems, fineOK int
	for _, it := range rep.Items {
		switch it.Area {
		case hung:
			hungItems++
			if it.Level != levelFail || !strings.Contains(it.What, "did not answer") || it.Fix == "" {
				t.Errorf("the hung mount: %s %q (fix %q): want a FAIL saying it did not answer, with a fix", it.Level, it.What, it.Fix)
			}
		case fine:
			if it.Level == levelOK {
				fineOK++
			}
		}
	}
	if hungItems != 1 || fineOK == 0 || rep.Fail == 0 {
		t.Errorf("%d findings on the hung mount (want 1), %d OK on the other (want some), %d failures: %+v", hungItems, fineOK, rep.Fail, rep.Items)
	}
}

// TestConfigShowFailsOnAMountWhoseStatfsDoesNotAnswer: `kvhost config
// show` of a mount without a capacity statfs's it to show the capacity the
// start would compute, and on a mount whose file system does not answer
// (an NFS or FUSE server that stopped answering) it hung. It now gives
// that statfs the start's bound and exits 1 with the start's error, naming
// the mount. The bound is the test's (server.statfs_timeout = "1ms"); the
// statfs is held until the test ends.
func TestConfigShowFailsOnAMountWhoseStatfsDoesNotAnswer(t *testing.T) {
	dir := t.TempDir()
	mount := filepath.Join(dir, "blocks")
	file := filepath.Join(dir, "kvhost.toml")
	src := fmt.Sprintf("[server]\nstatfs_timeout = \"1ms\"\n\n[policy]\ncache_dir = %q\n\n[[mount]]\npath = %q\n", policyCache, mount)
	if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	release, asked := make(chan struct{}), make(chan struct{}, 1)
	defer close(release) // the statfs left behind returns
	mc := machine{statfs: func(path string) (fsys.StatFS, error) {
		asked <- struct{}{}
		<-release
		return fsys.OS{}.Statfs(path)
	}}
	stdout, stderr, exit := runBackground(func(stdout, stderr io.Writer) int {
		return runConfigShowOn(context.Background(), mc, []string{"--config", file}, stdout, stderr)
	})
	code := awaitValue(t, "config show beside a hung mount to end", exit)
	if len(asked) == 0 {
		t.Fatalf("config show did not statfs the mount (exit %d):\n%s", code, stderr)
	}
	if msg := stderr.String(); code != 1 || !strings.Contains(msg, mount) || !strings.Contains(msg, "did not answer") {
		t.Fatalf("exit %d, stderr %q: want 1 and an error naming the mount %s that did not answer", code, msg, mount)
	}
	if stdout.String() != "" {
		t.Errorf("a configuration was printed beside the error:\n%s", stdout)
	}
}

// TestCheckEndsWhereTheDirectoryAboveAnAbsentMountDoesNotAnswer: a mount
// whose path does not exist yet answers check's first statfs (ENOENT: a
// lookup the mount's client may answer from its cache), and check then
// asked the file system of the directory above it, where the start would
// make it, with no bound: for its name in the "does not exist" warning,
// and, where the tiered policy's tiers are checked, whether it is a
// memory file system. On a hung mount either call hung check. Both now
// have the first statfs's bound: where the mount is to be made there, the
// mount FAILs as hung; where it cannot be (not writable, a FAIL of its
// own), the tier check takes it for no memory mount and check ends. The
// bound of the held statfs is the test's (a millisecond, heldOnly); the
// statfs is held until the test ends.
func TestCheckEndsWhereTheDirectoryAboveAnAbsentMountDoesNotAnswer(t *testing.T) {
	for _, c := range []struct {
		name     string
		writable bool
		want     string // in the mount's FAIL
	}{
		{"where the start would make it", true, "did not answer"},
		{"where it cannot be made", false, "not writable"},
	} {
		t.Run(c.name, func(t *testing.T) {
			fine, above := t.TempDir(), t.TempDir()
			absent := filepath.Join(above, "blocks")
			release, asked := make(chan struct{}), make(chan struct{}, 1)
			defer close(release) // the statfs left behind returns
			o := checkOptions{cfg: config.Default(), mountWait: heldOnly(above),
				statfs: func(path string, st *unix.Statfs_t) error {
					if path == above {
						select {
						case asked <- struct{}{}:
						default:
						}
						<-release
					}
					return unix.Statfs(path, st)
				},
				access: func(path string, mode uint32) error {
					if path == above && !c.writable {
						return unix.EACCES
					}
					return unix.Access(path, mode)
				}}
			o.cfg.GPU.Mode, o.cfg.GPU.CuFile = "off", "off"
			o.cfg.Policy.Name, o.cfg.Policy.CacheDir = "tiered", policyCache
			// The absent mount is the cold one: the tier check asks first
			// whether it is memory.
			o.cfg.Mounts = []config.Mount{{Path: fine}, {Path: absent}}
			checked := make(chan *checkReport, 1)
			go func() { checked <- doCheck(context.Background(), o) }()
			rep := awaitValue(t, "the check beside a hung directory to end", checked)
			if len(asked) == 0 {
				t.Fatalf("check did not statfs %s, the directory above the mount: %+v", above, rep.Items)
			}
			var fails int
			for _, it := range rep.Items {
				if it.Area == absent && it.Level == levelFail && strings.Contains(it.What, c.want) {
					fails++
				}
			}
			if fails != 1 {
				t.Errorf("the absent mount's findings: want one FAIL saying %q: %+v", c.want, rep.Items)
			}
		})
	}
}

// heldOnly is a checkOptions.mountWait that bounds the statfs of held,
// the path whose statfs the test holds, by a millisecond, and every other
// by testwait.Hang: the statfs of a mount that answers must not FAIL for
// want of a millisecond, which a loaded machine may take to run the
// goroutine that asks it (a check of 1 ms for every mount failed its fine
// mount 1 time in 300 beside another build).
func heldOnly(held string) func(path string) time.Duration {
	return func(path string) time.Duration {
		if path == held {
			return time.Millisecond
		}
		return testwait.Hang
	}
}

// awaitValue waits for ch's value, which a call under test sends once it
// returns, and returns it; what names the call in the failure.
func awaitValue[T any](t *testing.T, what string, ch <-chan T) T {
	t.Helper()
	var v T
	testwait.Until(t, what, testwait.Hang, func() bool {
		select {
		case v = <-ch:
			return true
		default:
			return false
		}
	})
	return v
}

// TestAStatfsSlowerThanTheDefaultPassesWithinStatfsTimeout: the bound on a
// mount's first statfs was 5 s, a constant, so a mount that answered
// slower (an NFS server under load, a FUSE mount waking) stopped the
// daemon's start, FAILed in `kvhost check` and failed `kvhost config
// show`, however the operator configured it. server.statfs_timeout now
// sets it, and each of the three takes it from the configuration: here a
// minute, with a statfs that answers after 6 s, past the default. The
// calls run in a synctest bubble, whose clock moves only once every
// goroutine in it waits: no test waits 6 s, and which comes first, the
// answer or the bound, is decided by the durations alone, never by the
// machine's speed.
func TestAStatfsSlowerThanTheDefaultPassesWithinStatfsTimeout(t *testing.T) {
	const answersAfter = 6 * time.Second // past config.DefaultStatfsTimeout
	for _, c := range []struct {
		name string
		// run asks the file system of cfg's mount its statfs through
		// statfs, as the command does, and returns what refused the
		// mount (nil: it was taken).
		run func(t *testing.T, cfg config.Config, statfs func(string) (fsys.StatFS, error)) error
	}{
		{"the start", func(t *testing.T, cfg config.Config, statfs func(string) (fsys.StatFS, error)) error {
			_, err := kvdaemon.EngineMounts(context.Background(), cfg, statfs)
			return err
		}},
		{"config show", func(t *testing.T, cfg config.Config, statfs func(string) (fsys.StatFS, error)) error {
			_, _, err := effectiveConfig(context.Background(), cfg, machine{statfs: statfs})
			return err
		}},
		{"check", func(t *testing.T, cfg config.Config, statfs func(string) (fsys.StatFS, error)) error {
			o := checkOptions{cfg: cfg, statfs: func(path string, st *unix.Statfs_t) error {
				if _, err := statfs(path); err != nil {
					return err
				}
				return unix.Statfs(path, st)
			}}
			for _, it := range doCheck(context.Background(), o).Items {
				if it.Level == levelFail {
					return fmt.Errorf("%s: FAIL %s", it.Area, it.What)
				}
			}
			return nil
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				cfg := config.Default()
				cfg.GPU.Mode, cfg.GPU.CuFile = "off", "off"
				cfg.Policy.CacheDir = policyCache
				cfg.Server.StatfsTimeout = config.Duration(time.Minute)
				cfg.Mounts = []config.Mount{{Path: t.TempDir(), HighWatermark: config.DefaultHighWatermark, LowWatermark: config.DefaultLowWatermark}}
				answer := make(chan struct{})
				answers := time.AfterFunc(answersAfter, func() { close(answer) })
				defer func() {
					if answers.Stop() { // the test failed first: let the statfs return
						close(answer)
					}
				}()
				var asked atomic.Bool
				slow := func(path string) (fsys.StatFS, error) {
					asked.Store(true)
					<-answer
					return fsys.OS{}.Statfs(path)
				}
				if err := c.run(t, cfg, slow); err != nil {
					t.Fatalf("a statfs answering after %v, within server.statfs_timeout = %v: %v", answersAfter, time.Duration(cfg.Server.StatfsTimeout), err)
				}
				if !asked.Load() {
					t.Fatal("the mount's statfs was not asked")
				}
			})
		})
	}
}
