package testlinks

import (
	"os"
	"path/filepath"
	"testing"
)

// errRecorder counts Errorf calls instead of failing the test.
type errRecorder struct {
	testing.TB
	errors int
}

func (r *errRecorder) Helper() {}
func (r *errRecorder) Errorf(string, ...any) {
	r.errors++
}

func TestUntouchedPassesATargetLeftAsItWasMade(t *testing.T) {
	tg := NewTarget(t, map[string][]byte{"a": []byte("1"), "b": []byte("2")})
	r := &errRecorder{TB: t}
	tg.Untouched(r)
	if r.errors != 0 {
		t.Fatalf("%d errors for a target no one touched", r.errors)
	}
}

func TestUntouchedFailsATargetWithAFileMadeRemovedOrChanged(t *testing.T) {
	tests := []struct {
		name   string
		change func(dir string) error
	}{
		{"made", func(dir string) error { return os.WriteFile(filepath.Join(dir, "c"), nil, 0o644) }},
		{"removed", func(dir string) error { return os.Remove(filepath.Join(dir, "a")) }},
		{"changed", func(dir string) error { return os.WriteFile(filepath.Join(dir, "b"), []byte("3"), 0o644) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tg := NewTarget(t, map[string][]byte{"a": []byte("1"), "b": []byte("2")})
			if err := tt.change(tg.Dir); err != nil {
				t.Fatal(err)
			}
			r := &errRecorder{TB: t}
			tg.Untouched(r)
			if r.errors == 0 {
				t.Fatalf("no error for a target with a file %s", tt.name)
			}
		})
	}
}

func TestSwapPutsALinkInPlaceOfADirectory(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "d")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	tg := NewTarget(t, nil)
	Swap(t, dir, tg.Dir)
	if got, err := os.Readlink(dir); err != nil || got != tg.Dir {
		t.Fatalf("at %s: a link to %q (%v), want one to %s", dir, got, err, tg.Dir)
	}
	if fi, err := os.Lstat(dir + ".old"); err != nil || !fi.IsDir() {
		t.Fatalf("%s.old: %v, want the directory moved there", dir, err)
	}
}
