package staging

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/fsys"
)

// refusesDirect is a file system without direct I/O, as Linux shows one
// (tmpfs before 6.6, FUSE file systems without direct_io): an open with
// O_DIRECT fails with EINVAL after O_CREAT has created the file (the
// kernel checks O_DIRECT once the file exists), or, atWrite, succeeds and
// its file's first write fails with EINVAL.
type refusesDirect struct {
	fsys.FS
	atWrite bool
}

func (r refusesDirect) OpenFile(name string, flag int, perm os.FileMode) (fsys.File, error) {
	if flag&unix.O_DIRECT == 0 {
		return r.FS.OpenFile(name, flag, perm)
	}
	f, err := r.FS.OpenFile(name, flag&^unix.O_DIRECT, perm)
	if err != nil {
		return nil, err
	}
	if r.atWrite {
		return refusedWrites{f}, nil
	}
	f.Close()
	return nil, &os.PathError{Op: "open", Path: name, Err: unix.EINVAL}
}

// refusedWrites is a file open with O_DIRECT whose writes fail.
type refusedWrites struct{ fsys.File }

func (f refusedWrites) WriteAt(p []byte, off int64) (int, error) {
	return 0, &os.PathError{Op: "pwrite", Path: "direct", Err: unix.EINVAL}
}

// TestProbeDirectOnAFileSystemRefusingDirectIOSaysNoAndLeavesNoFile: where
// the file system refuses O_DIRECT, at the open (which has created the
// file) or at the first write, ProbeDirect reports false with no error and
// the directory is left as it was.
func TestProbeDirectOnAFileSystemRefusingDirectIOSaysNoAndLeavesNoFile(t *testing.T) {
	for _, tt := range []struct {
		name    string
		atWrite bool
	}{
		{"at the open", false},
		{"at the first write", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			direct, err := ProbeDirect(refusesDirect{FS: fsys.OS{}, atWrite: tt.atWrite}, dir)
			if err != nil || direct {
				t.Fatalf("ProbeDirect: %v, %v: want false, nil", direct, err)
			}
			ents, err := os.ReadDir(dir)
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range ents {
				t.Errorf("file left by the O_DIRECT probe: %s", e.Name())
			}
		})
	}
}

// TestProbeDirectFileLeavesAnExistingFile: the probe's name must not
// exist; where it does, the probe fails and leaves that file as it was.
func TestProbeDirectFileLeavesAnExistingFile(t *testing.T) {
	name := t.TempDir() + "/taken"
	if err := os.WriteFile(name, []byte("kept"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, fs := range []fsys.FS{fsys.OS{}, refusesDirect{FS: fsys.OS{}}} {
		if _, err := ProbeDirectFile(fs, name); err == nil {
			t.Fatalf("%T: ProbeDirectFile on an existing name: nil error", fs)
		}
		if b, err := os.ReadFile(name); err != nil || string(b) != "kept" {
			t.Fatalf("%T: the existing file after the probe: %q, %v: want \"kept\"", fs, b, err)
		}
	}
}
