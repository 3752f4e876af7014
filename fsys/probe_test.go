package fsys_test

import (
	"os"
	"testing"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/fsys/fsystest"
)

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
			direct, err := fsys.ProbeDirect(fsystest.RefusesDirect{FS: fsys.OS{}, AtWrite: tt.atWrite}, dir)
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
	for _, fs := range []fsys.FS{fsys.OS{}, fsystest.RefusesDirect{FS: fsys.OS{}}} {
		if _, made, err := fsys.ProbeDirectFile(fs, name, 0); err == nil || made {
			t.Fatalf("%T: ProbeDirectFile on an existing name: made %v, error %v: want an error, and nothing made", fs, made, err)
		}
		if b, err := os.ReadFile(name); err != nil || string(b) != "kept" {
			t.Fatalf("%T: the existing file after the probe: %q, %v: want \"kept\"", fs, b, err)
		}
	}
}
