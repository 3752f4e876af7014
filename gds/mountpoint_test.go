package gds

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestMountPointFindsTheMountOfAFilesDevice: /proc/self/mountinfo names
// a mount of the device a temporary directory is on, and it exists. (A
// device mounted several times, bind mounts among them, gives its first.)
func TestMountPointFindsTheMountOfAFilesDevice(t *testing.T) {
	dir, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		t.Fatal(err)
	}
	p := mountPoint(uint64(st.Dev))
	if p == "" {
		t.Fatalf("no mount point for device %d:%d of %s", unix.Major(uint64(st.Dev)), unix.Minor(uint64(st.Dev)), dir)
	}
	if _, err := os.Stat(p); err != nil {
		t.Fatal(err)
	}
}
