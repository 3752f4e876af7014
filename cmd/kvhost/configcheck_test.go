package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/testsock"
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
			src := fmt.Sprintf("[server]\nsocket = %q\n\n[[mount]]\npath = %q\n\n[[mount]]\npath = %q\n%s", filepath.Join(testsock.Dir(t), "s.sock"), tt.outer, tt.second, layout)
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

// TestChecksRefuseTheParamsThePolicyRefusesAtStart: a [policy.params]
// value or key the built-in policy's kvhost_init refuses, which stops the
// daemon's start, fails config check, config show and kvhost check
// --config alike, at the key's line, and names the policy once; so does
// the tiered example run with --policy lru (lru has no hot or cold). The
// example as it is passes.
func TestChecksRefuseTheParamsThePolicyRefusesAtStart(t *testing.T) {
	dir := t.TempDir()
	example, err := os.ReadFile(filepath.Join("..", "..", "examples", "tiered.toml"))
	if err != nil {
		t.Fatal(err)
	}
	src := strings.NewReplacer(`"/dev/shm/kvhost-hot"`, fmt.Sprintf("%q", filepath.Join(dir, "hot")),
		`"/var/tmp/kvhost-cold"`, fmt.Sprintf("%q", filepath.Join(dir, "cold"))).Replace(string(example))
	src += fmt.Sprintf("\n[server]\nsocket = %q\n", filepath.Join(testsock.Dir(t), "s.sock"))
	window := strings.Index(src, `promote_window = "60s"`)
	if window < 0 {
		t.Fatal(`examples/tiered.toml sets no promote_window = "60s"`)
	}
	line := strings.Count(src[:window], "\n") + 1
	tests := []struct {
		name  string
		src   string
		flags []string
		want  string // after the file's name, a regular expression; "": ok
	}{
		{"the example", src, nil, ""},
		{"a value the policy refuses", strings.Replace(src, `"60s"`, `"sixty"`, 1), nil,
			fmt.Sprintf(`:%d: policy\.params\.promote_window: policy tiered: kvhost_init`, line)},
		{"a misspelt key", strings.Replace(src, `promote_window = "60s"`, "keys_per_fil = 8", 1), nil,
			fmt.Sprintf(`:%d: policy\.params\.keys_per_fil: policy tiered: kvhost_init`, line)},
		{"another policy than the params'", src, []string{"--policy", "lru"}, `:\d+: policy\.params\.(hot|cold|promote_hits|promote_window): policy lru: kvhost_init`},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			file := filepath.Join(dir, fmt.Sprintf("c%d.toml", i))
			at := regexp.MustCompile(regexp.QuoteMeta(file) + tt.want)
			if err := os.WriteFile(file, []byte(tt.src), 0o644); err != nil {
				t.Fatal(err)
			}
			commands := [][]string{append([]string{"show", "--config", file}, tt.flags...)}
			if tt.flags == nil {
				commands = append(commands, []string{"check", file})
			}
			for _, args := range commands {
				var out, errb bytes.Buffer
				code := runConfig(context.Background(), args, &out, &errb)
				if tt.want == "" {
					if code != 0 {
						t.Errorf("config %s: exit %d, stderr %s; want 0", args[0], code, errb.String())
					}
					continue
				}
				if msg := errb.String(); code != 1 || !at.MatchString(msg) || !strings.Contains(msg, "the daemon would not start") || strings.Count(msg, "policy tiered:") > 1 {
					t.Errorf("config %s: exit %d, stderr %q; want 1 and an error matching %s", args[0], code, msg, at)
				}
			}
			if tt.flags != nil {
				return // kvhost check takes no --policy
			}
			cfg, err := config.Load(file)
			if err != nil {
				t.Fatal(err)
			}
			o := checkOptions{cfg: cfg, file: file}
			o.cfg.GPU.Mode, o.cfg.GPU.CuFile = "off", "off"
			rep := doCheck(context.Background(), o)
			var policy []checkItem
			for _, it := range rep.Items {
				if it.Area == "policy" {
					policy = append(policy, it)
				}
			}
			failed := len(policy) == 1 && policy[0].Level == levelFail && rep.Fail > 0
			if tt.want == "" && failed || tt.want != "" && (!failed || !at.MatchString(policy[0].What)) {
				t.Errorf("kvhost check: policy findings %+v (%d failures); want a FAIL matching %s: %v", policy, rep.Fail, at, tt.want != "")
			}
		})
	}
}

// TestConfigCheckRefusesAnUnknownFlagAsAUsageError: an argument of
// config check that begins with '-', before or after the files, is a
// flag, and one config check does not have is a usage error (exit 2, the
// flag named on stderr, no file checked), not a file that cannot be
// opened (exit 1); a file whose name begins with '-' is checked as
// ./-x.toml, or after --, which ends the flags.
func TestConfigCheckRefusesAnUnknownFlagAsAUsageError(t *testing.T) {
	t.Chdir(t.TempDir())
	for _, f := range []string{"ok.toml", "-x.toml"} {
		if err := os.WriteFile(f, []byte("# the defaults\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		args   []string
		code   int
		stdout string // the whole of stdout
		stderr string // a substring of stderr; "" wants it empty
	}{
		{[]string{"--bogus"}, 2, "", "-bogus"},
		{[]string{"ok.toml", "--bogus"}, 2, "", "-bogus"},
		{[]string{"--bogus=1", "ok.toml"}, 2, "", "-bogus"},
		{[]string{"-x.toml"}, 2, "", "-x.toml"},
		{[]string{"--"}, 2, "", "usage: kvhost config check"},
		{[]string{"./-x.toml"}, 0, "./-x.toml: ok\n", ""},
		{[]string{"--", "-x.toml"}, 0, "-x.toml: ok\n", ""},
		{[]string{"ok.toml", "--", "-x.toml", "--bogus"}, 1, "ok.toml: ok\n-x.toml: ok\n", "--bogus"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			var out, errb bytes.Buffer
			code := run(t.Context(), append([]string{"config", "check"}, tt.args...), &out, &errb)
			if code != tt.code {
				t.Errorf("exit %d, want %d", code, tt.code)
			}
			if out.String() != tt.stdout {
				t.Errorf("stdout %q, want %q", out.String(), tt.stdout)
			}
			if tt.stderr == "" && errb.Len() != 0 || !strings.Contains(errb.String(), tt.stderr) {
				t.Errorf("stderr %q, want it to contain %q (or be empty where nothing is wanted)", errb.String(), tt.stderr)
			}
			if tt.code == 2 && strings.Contains(errb.String(), "no such file") {
				t.Errorf("stderr %q: a flag taken for a file", errb.String())
			}
		})
	}
}
