package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestConfigCheckAndShowRefuseMountsThatOverlap: mounts of kvhost's
// layout that are one directory or one inside the other, which the
// daemon refuses at start, fail config check and config show with the
// later mount's path line, whether the directories exist (compared as
// the engine compares them, through a symbolic link too) or the daemon
// would make them; mounts side by side, a sibling whose name only begins
// like another's, and a vllm-fs mount inside a kvhost one do not.
func TestConfigCheckAndShowRefuseMountsThatOverlap(t *testing.T) {
	dir := t.TempDir()
	made, link := filepath.Join(dir, "made"), filepath.Join(dir, "link")
	if err := os.MkdirAll(filepath.Join(made, "inner"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(made, link); err != nil {
		t.Fatal(err)
	}
	absent := filepath.Join(dir, "absent")
	tests := []struct {
		name   string
		second string // the second mount's path; the first's is outer
		outer  string
		layout string
		fail   bool
	}{
		{"one inside the other, not made yet", filepath.Join(absent, "b"), absent, "", true},
		{"one inside the other, both made", filepath.Join(made, "inner"), made, "", true},
		{"one directory through a link", link, made, "", true},
		{"inside a link to the other, not made yet", filepath.Join(link, "new"), made, "", true},
		{"side by side", filepath.Join(dir, "other"), absent, "", false},
		{"a name that begins like the other's", absent + "x", absent, "", false},
		{"a vllm-fs mount inside", filepath.Join(absent, "v"), absent, "vllm-fs", false},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			layout := ""
			if tt.layout != "" {
				layout = fmt.Sprintf("layout = %q\n", tt.layout)
			}
			file := filepath.Join(dir, fmt.Sprintf("c%d.toml", i))
			src := fmt.Sprintf("[server]\nsocket = %q\n\n[[mount]]\npath = %q\n\n[[mount]]\npath = %q\n%s", filepath.Join(dir, "s.sock"), tt.outer, tt.second, layout)
			if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
				t.Fatal(err)
			}
			for _, args := range [][]string{{"check", file}, {"show", "--config", file}} {
				var out, errb bytes.Buffer
				code := runConfig(context.Background(), args, &out, &errb)
				if !tt.fail {
					if code != 0 {
						t.Errorf("config %s: exit %d, stderr %s; want 0", args[0], code, errb.String())
					}
					continue
				}
				want := file + ":8: mount.path: "
				if code != 1 || !strings.Contains(errb.String(), want) || !strings.Contains(errb.String(), "overlap") {
					t.Errorf("config %s: exit %d, stderr %q; want 1 and an error at %q saying the mounts overlap", args[0], code, errb.String(), want)
				}
			}
		})
	}
}
