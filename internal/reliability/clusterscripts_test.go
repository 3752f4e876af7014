package reliability

// The cluster scripts' clean-up (scripts/cephfs.sh, cluster-common.sh):
// what an interrupted, killed or timed-out run leaves in its directory
// must not outlive the next `down`, nor a busy port pass unnamed. These
// need no Ceph: `down` of a directory whose daemons have no pid file, and
// `up` stopping at a monitor port another process listens on.

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

const cephfsScript = "../../scripts/cephfs.sh"

// runScript runs a cluster script with env added, bounded by a minute (not
// by the test's context: clean-ups run it too); its exit status and its
// stderr.
func runScript(t *testing.T, env []string, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, cephfsScript, args...)
	cmd.Env = append(os.Environ(), env...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0, stderr.String()
	case errors.As(err, &exit) && ctx.Err() == nil:
		return exit.ExitCode(), stderr.String()
	default:
		t.Fatalf("%s %v: %v; stderr:\n%s", cephfsScript, args, err, stderr.String())
		return 0, ""
	}
}

// TestCephfsDownStopsWhatARunLeft: `down` stops a process holding a file
// under the cluster's directory though no pid file names it (a test's
// daemon that a timed-out go test left, a daemon started without its pid
// file), unmounts what is mounted there (as root: a tmpfs standing for a
// client's mount) and removes the directory; a pid file naming a process
// that is gone does not stop it. A directory that is not a cluster's is
// left alone.
func TestCephfsDownStopsWhatARunLeft(t *testing.T) {
	for _, tc := range []struct {
		name  string
		mount bool // a tmpfs at DIR/node1, the held file on it
	}{
		{"a file under the directory", false},
		{"a file on a mount under the directory", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.mount && os.Geteuid() != 0 {
				t.Skip("mounting a tmpfs needs root")
			}
			dir, err := os.MkdirTemp("/tmp", "kvhost-downtest-")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				unix.Unmount(filepath.Join(dir, "node1"), unix.MNT_DETACH)
				os.RemoveAll(dir)
			})
			held := filepath.Join(dir, "log")
			for _, d := range []string{"run", "log", "node1"} {
				if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			if tc.mount {
				if err := unix.Mount("tmpfs", filepath.Join(dir, "node1"), "tmpfs", 0, "size=1m"); err != nil {
					t.Fatalf("mount a tmpfs: %v", err)
				}
				held = filepath.Join(dir, "node1")
			}
			if err := os.WriteFile(filepath.Join(dir, "ceph.conf"), []byte("# a test's\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			// A pid file naming a process that has exited.
			gone := exec.Command("true")
			if err := gone.Run(); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "run", "mon.a.pid"), []byte(strconv.Itoa(gone.Process.Pid)), 0o644); err != nil {
				t.Fatal(err)
			}
			f, err := os.Create(filepath.Join(held, "f"))
			if err != nil {
				t.Fatal(err)
			}
			leftover := exec.Command("sleep", "600")
			leftover.ExtraFiles = []*os.File{f}
			if err := leftover.Start(); err != nil {
				t.Fatal(err)
			}
			f.Close()
			exited := make(chan error, 1)
			go func() { exited <- leftover.Wait() }()
			t.Cleanup(func() { leftover.Process.Kill() })

			if rc, stderr := runScript(t, nil, "down", dir); rc != 0 {
				t.Fatalf("down %s: exit status %d; stderr:\n%s", dir, rc, stderr)
			}
			select {
			case err := <-exited:
				var exit *exec.ExitError
				if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGTERM {
					t.Errorf("the process holding %s/f ended with %v, want SIGTERM", held, err)
				}
			case <-time.After(30 * time.Second):
				t.Fatalf("the process holding %s/f still runs 30 s after down returned", held)
			}
			if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s after down: %v, want it removed", dir, err)
			}
		})
	}
	t.Run("not a cluster's directory", func(t *testing.T) {
		dir := t.TempDir()
		if rc, stderr := runScript(t, nil, "down", dir); rc == 0 || !strings.Contains(stderr, "left alone") {
			t.Errorf("down %s: exit status %d, stderr %q; want a refusal that leaves it alone", dir, rc, stderr)
		}
		if _, err := os.Stat(dir); err != nil {
			t.Errorf("%s after the refused down: %v", dir, err)
		}
	})
}

// TestCephfsUpNamesTheHolderOfABusyPort: where the monitor's port is
// taken, `up` stops before starting anything and names the process that
// listens on it (this test), so that another run's monitor never answers
// this cluster's commands. Needs what `up` needs: root, /dev/fuse and the
// Ceph packages installed (the check comes after the install step, which
// must not run apt-get here).
func TestCephfsUpNamesTheHolderOfABusyPort(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("cephfs.sh up needs root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("cephfs.sh up needs /dev/fuse: %v", err)
	}
	for _, p := range []string{"ceph-mon", "ceph-osd", "ceph-mds", "ceph-fuse", "ceph"} {
		if _, err := exec.LookPath(p); err != nil {
			t.Skipf("Ceph is not installed (%s: %v)", p, err)
		}
	}
	var ls [2]net.Listener
	for i := range ls {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		ls[i] = l
	}
	port := func(l net.Listener) string { return strconv.Itoa(l.Addr().(*net.TCPAddr).Port) }
	dir, err := os.MkdirTemp("/tmp", "kvhost-porttest-")
	if err != nil {
		t.Fatal(err)
	}
	os.Remove(dir) // up makes it
	t.Cleanup(func() { runScript(t, nil, "down", dir) })
	env := []string{"CEPHFS_MON_PORT=" + port(ls[0]), "CEPHFS_MON_PORT2=" + port(ls[1]), "CEPHFS_PICK_PORTS=0"}
	rc, stderr := runScript(t, env, "up", dir, "1")
	if rc == 0 {
		t.Fatalf("up with both monitor ports taken: exit status 0; stderr:\n%s", stderr)
	}
	for _, want := range []string{"port " + port(ls[0]) + ": pid " + strconv.Itoa(os.Getpid()), "port " + port(ls[1]) + ": pid " + strconv.Itoa(os.Getpid())} {
		if !strings.Contains(stderr, want) {
			t.Errorf("up's stderr does not name the holder (%q):\n%s", want, stderr)
		}
	}
	if strings.Contains(stderr, "start monitor") {
		t.Errorf("up went on to start a monitor:\n%s", stderr)
	}
}
