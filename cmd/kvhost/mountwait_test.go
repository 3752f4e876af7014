package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/fsys"
	"github.com/kvhost/kvhost/internal/fsys/fsystest"
	"github.com/kvhost/kvhost/internal/testsock"
	"github.com/kvhost/kvhost/internal/testwait"
)

// TestServeRefusesToStartOnAMountWhoseStatfsDoesNotAnswer: a mount whose
// file system does not answer statfs (an NFS or FUSE server that stopped
// answering) held the daemon's start without end, in the engine's Open
// (or, without a configured capacity, in the statfs that sizes the
// mount). The start now gives it a bound and fails, with status 1 and an
// error naming the mount, whether or not a capacity is configured. The
// bound is the test's (a millisecond); the statfs is held until the test
// ends.
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
			src := fmt.Sprintf("[server]\nsocket = %q\n\n[log]\nformat = \"json\"\n\n[policy]\ncache_dir = %q\n\n[[mount]]\npath = %q\n%s\n",
				socket, policyCache, mount, c.capacity)
			if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
				t.Fatal(err)
			}
			hold := &fsystest.Hold{}
			hold.Arm(fsys.OpStatfs)
			defer hold.Release() // the statfs left behind returns
			_, stderr, exit := runBackground(func(stdout, stderr io.Writer) int {
				return runServeOn(context.Background(), serveSeams{fs: &fsys.Faulty{FS: fsys.OS{}, Inj: hold}, mountWait: time.Millisecond},
					[]string{"--config", file}, stdout, stderr)
			})
			var code int
			testwait.Until(t, "the start on a hung mount to end", testwait.Hang, func() bool {
				select {
				case code = <-exit:
					return true
				default:
					return false
				}
			})
			if !hold.Holding() {
				t.Fatalf("the start did not reach the mount's statfs (exit %d):\n%s", code, stderr)
			}
			line := stderr.logLine(t, "kvhost stopped")
			msg, _ := line["err"].(string)
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
	o := checkOptions{cfg: config.Default(), mountWait: time.Millisecond, statfs: func(path string, st *unix.Statfs_t) error {
		if path == hung {
			<-release
		}
		return unix.Statfs(path, st)
	}}
	o.cfg.GPU.Mode, o.cfg.GPU.CuFile = "off", "off"
	o.cfg.Mounts = []config.Mount{{Path: hung}, {Path: fine}}
	checked := make(chan *checkReport, 1)
	go func() { checked <- doCheck(context.Background(), o) }()
	var rep *checkReport
	testwait.Until(t, "the check beside a hung mount to end", testwait.Hang, func() bool {
		select {
		case rep = <-checked:
			return true
		default:
			return false
		}
	})
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
// the mount. The bound is the test's (a millisecond); the statfs is held
// until the test ends.
func TestConfigShowFailsOnAMountWhoseStatfsDoesNotAnswer(t *testing.T) {
	dir := t.TempDir()
	mount := filepath.Join(dir, "blocks")
	file := filepath.Join(dir, "kvhost.toml")
	src := fmt.Sprintf("[policy]\ncache_dir = %q\n\n[[mount]]\npath = %q\n", policyCache, mount)
	if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	release, asked := make(chan struct{}), make(chan struct{}, 1)
	defer close(release) // the statfs left behind returns
	mc := machine{mountWait: time.Millisecond, statfs: func(path string) (fsys.StatFS, error) {
		asked <- struct{}{}
		<-release
		return fsys.OS{}.Statfs(path)
	}}
	stdout, stderr, exit := runBackground(func(stdout, stderr io.Writer) int {
		return runConfigShowOn(context.Background(), mc, []string{"--config", file}, stdout, stderr)
	})
	var code int
	testwait.Until(t, "config show beside a hung mount to end", testwait.Hang, func() bool {
		select {
		case code = <-exit:
			return true
		default:
			return false
		}
	})
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
