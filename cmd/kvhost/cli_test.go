package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/testsock"
)

func TestHelpListsEveryCommandAndTheDaemonFlags(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"--help"}, &out, &errb); code != 0 {
		t.Fatalf("exit %d, stderr %s", code, errb.String())
	}
	for name, c := range commands() {
		if !strings.Contains(out.String(), fmt.Sprintf("  %-8s %s\n", name, c.summary)) {
			t.Errorf("--help does not list command %q:\n%s", name, out.String())
		}
	}
	for _, want := range []string{"-config", "-dir", "-socket", "-policy", "-capacity", "tiered"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("--help does not mention %q:\n%s", want, out.String())
		}
	}
	// The flags are spelt --name, as the docs write them, and the exit
	// statuses are given.
	for _, want := range []string{"\n  --config file\n", "\n  --policy name\n", "\nexit status:\n", "\n  1  runtime failure", "\n  2  usage or configuration error"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("--help lacks %q:\n%s", want, out.String())
		}
	}
	if regexp.MustCompile(`(?m)^  -[a-z]`).MatchString(out.String()) {
		t.Errorf("--help spells a flag -name:\n%s", out.String())
	}
}

// TestABadFlagValueIsOneLineThatPointsToHelp: a bad flag or value is
// one line on stderr naming the flag --name, ending "see kvhost serve
// --help", and exit 2; the usage is not repeated (it was 29 lines).
func TestABadFlagValueIsOneLineThatPointsToHelp(t *testing.T) {
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"--io-workers", "x"}, `kvhost serve: invalid value "x" for flag --io-workers: parse error (see kvhost serve --help)` + "\n"},
		{[]string{"-io-workers=x"}, `kvhost serve: invalid value "x" for flag --io-workers: parse error (see kvhost serve --help)` + "\n"},
		{[]string{"--no-such-flag"}, "kvhost serve: flag provided but not defined: --no-such-flag (see kvhost serve --help)\n"},
		{[]string{"stats", "--timeout"}, "kvhost stats: flag needs an argument: --timeout (see kvhost stats --help)\n"},
	} {
		var out, errb bytes.Buffer
		if code := run(t.Context(), tt.args, &out, &errb); code != 2 || errb.String() != tt.want || out.Len() != 0 {
			t.Errorf("kvhost %s: exit %d, stdout %q, stderr %q; want 2 and stderr %q", strings.Join(tt.args, " "), code, out.String(), errb.String(), tt.want)
		}
	}
}

// TestEveryCommandAndItsFlagsAreDocumented: every command of `kvhost
// --help` has a page of docs/ that names it (`kvhost NAME`), and every
// flag that the command's --help lists is named there too, as -NAME or
// --NAME: a command or a flag added to the code and not to its page
// fails here.
func TestEveryCommandAndItsFlagsAreDocumented(t *testing.T) {
	pages := map[string]struct {
		help []string // the arguments that print the command's flags
		page string   // the page under docs/ that documents the command
	}{
		"serve":  {[]string{"serve", "--help"}, "serve.md"},
		"stats":  {[]string{"stats", "--help"}, "serve.md"},
		"health": {[]string{"health", "--help"}, "serve.md"},
		"reload": {[]string{"reload", "--help"}, "serve.md"},
		"purge":  {[]string{"purge", "--help"}, "serve.md"},
		"check":  {[]string{"check", "--help"}, "bench.md"},
		"bench":  {[]string{"bench", "--help"}, "bench.md"},
		"policy": {[]string{"policy", "--help"}, "policy-host.md"},
		// config show takes the daemon's flags, which config.md names
		// beside the keys they set.
		"config":  {[]string{"config", "show", "--help"}, "config.md"},
		"version": {[]string{"version", "--help"}, "serve.md"},
	}
	flagLine := regexp.MustCompile(`(?m)^  --?([a-z0-9][a-z0-9-]*)`)
	for name := range commands() {
		p, ok := pages[name]
		if !ok {
			t.Errorf("kvhost %s has no page of docs/ in this test's table", name)
			continue
		}
		doc, err := os.ReadFile(filepath.Join("..", "..", "docs", p.page))
		if err != nil {
			t.Fatal(err)
		}
		if !regexp.MustCompile(`kvhost ` + name + `\b`).Match(doc) {
			t.Errorf("docs/%s does not name kvhost %s", p.page, name)
		}
		var out, errb bytes.Buffer
		if code := run(context.Background(), p.help, &out, &errb); code != 0 {
			t.Fatalf("kvhost %s: exit %d, stderr %s", strings.Join(p.help, " "), code, errb.String())
		}
		for _, f := range flagLine.FindAllStringSubmatch(out.String()+errb.String(), -1) {
			named := regexp.MustCompile(`(^|[^A-Za-z0-9-])--?` + regexp.QuoteMeta(f[1]) + `($|[^A-Za-z0-9-])`)
			if !named.Match(doc) {
				t.Errorf("kvhost %s: flag -%s is not in docs/%s", name, f[1], p.page)
			}
		}
	}
}

// TestEveryCommandsHelpGoesToStdoutAndAUsageErrorToStderr: every
// command that `kvhost --help` lists, and the subcommands of config and
// policy, print the usage asked for with --help or -h once, on stdout,
// with nothing on stderr, and exit 0; an unknown flag is a usage error:
// exit 2, the flag named on stderr with the usage at most once, nothing
// on stdout (as git, go and kubectl do), whichever command's flags it is.
func TestEveryCommandsHelpGoesToStdoutAndAUsageErrorToStderr(t *testing.T) {
	var list, errb bytes.Buffer
	if code := run(t.Context(), []string{"--help"}, &list, &errb); code != 0 {
		t.Fatalf("kvhost --help: exit %d, stderr %s", code, errb.String())
	}
	_, listed, ok := strings.Cut(list.String(), "\ncommands:\n")
	listed, _, _ = strings.Cut(listed, "\n\n")
	if !ok || listed == "" {
		t.Fatalf("kvhost --help lists no commands:\n%s", list.String())
	}
	var cmds [][]string
	for _, line := range strings.Split(listed, "\n") {
		cmds = append(cmds, strings.Fields(line)[:1])
	}
	cmds = append(cmds, []string{"config", "check"}, []string{"config", "show"}, []string{"policy", "inspect"}, []string{"policy", "test"})
	for _, cmd := range cmds {
		name := strings.Join(cmd, " ")
		for _, help := range []string{"--help", "-h"} {
			t.Run(name+" "+help, func(t *testing.T) {
				var out, errb bytes.Buffer
				if code := run(t.Context(), append(slices.Clone(cmd), help), &out, &errb); code != 0 {
					t.Errorf("exit %d, want 0", code)
				}
				if !strings.HasPrefix(out.String(), "usage:") || !strings.Contains(out.String(), cmd[len(cmd)-1]) {
					t.Errorf("stdout %q, want the usage of kvhost %s", out.String(), name)
				}
				if n := strings.Count(out.String(), "usage:"); n != 1 {
					t.Errorf("the usage is printed %d times, want once:\n%s", n, out.String())
				}
				if errb.Len() != 0 {
					t.Errorf("stderr %q, want nothing", errb.String())
				}
			})
		}
		t.Run(name+" --bogus", func(t *testing.T) {
			var out, errb bytes.Buffer
			if code := run(t.Context(), append(slices.Clone(cmd), "--bogus"), &out, &errb); code != 2 {
				t.Errorf("exit %d, want 2", code)
			}
			if !strings.Contains(errb.String(), "-bogus") {
				t.Errorf("stderr %q, want it to name -bogus", errb.String())
			}
			if n := strings.Count(errb.String(), "usage:"); n > 1 {
				t.Errorf("the usage is printed %d times, want at most once:\n%s", n, errb.String())
			}
			if out.Len() != 0 {
				t.Errorf("stdout %q, want nothing", out.String())
			}
		})
	}
}

func TestVersionFlagAndCommandAgree(t *testing.T) {
	var a, b, errb bytes.Buffer
	if code := run(context.Background(), []string{"--version"}, &a, &errb); code != 0 {
		t.Fatalf("--version: exit %d: %s", code, errb.String())
	}
	if code := run(context.Background(), []string{"version"}, &b, &errb); code != 0 {
		t.Fatalf("version: exit %d: %s", code, errb.String())
	}
	if a.String() != b.String() || !strings.HasPrefix(a.String(), "kvhost ") {
		t.Fatalf("--version %q, version %q", a.String(), b.String())
	}
}

// TestVersionHelpDescribesTheCommandAndArgumentsAreRefused: `kvhost
// version --help` prints its usage, as `kvhost COMMAND --help` does for
// every command, not the version; an argument it does not take is a usage
// error (exit 2) naming it, as for every other command, not ignored, and
// so it is after `kvhost --version`, its other spelling. --help first
// prints the usage whatever follows, as for every command.
func TestVersionHelpDescribesTheCommandAndArgumentsAreRefused(t *testing.T) {
	cases := []cmdLine{
		{[]string{"version"}, 0, "kvhost ", ""},
		{[]string{"version", "--help"}, 0, "usage: kvhost version", ""},
		{[]string{"version", "-h"}, 0, "usage: kvhost version", ""},
		{[]string{"version", "--bogus"}, 2, "", "-bogus"},
		{[]string{"version", "extra"}, 2, "", `unexpected argument "extra"`},
		{[]string{"version", "--help", "extra"}, 0, "usage: kvhost version", ""},
		{[]string{"--version"}, 0, "kvhost ", ""},
		{[]string{"--version", "extra"}, 2, "", `unexpected argument "extra"`},
		{[]string{"--version", "--bogus"}, 2, "", "-bogus"},
	}
	for _, c := range cases {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			out := c.check(t)
			if c.code == 0 && len(c.args) > 1 && strings.Contains(out, runtime.Version()) {
				t.Errorf("--help printed the version:\n%s", out)
			}
		})
	}
}

// cmdLine is a kvhost command line and what it does: its exit status,
// and a substring of stdout and one of stderr ("" wants that stream
// empty).
type cmdLine struct {
	args   []string
	code   int
	stdout string
	stderr string
}

// check runs the command line and fails t where its exit status or a
// stream is not as wanted; it returns stdout.
func (c cmdLine) check(t *testing.T) string {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(t.Context(), c.args, &out, &errb)
	if code != c.code {
		t.Errorf("kvhost %s: exit %d, want %d", strings.Join(c.args, " "), code, c.code)
	}
	for _, s := range []struct{ name, got, want string }{{"stdout", out.String(), c.stdout}, {"stderr", errb.String(), c.stderr}} {
		if s.want == "" && s.got != "" || !strings.Contains(s.got, s.want) {
			t.Errorf("kvhost %s: %s %q, want it to contain %q (or be empty where nothing is wanted)", strings.Join(c.args, " "), s.name, s.got, s.want)
		}
	}
	return out.String()
}

func TestConfigCheck(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join("..", "..", "examples", "kvhost.toml")
	bad := filepath.Join(dir, "bad.toml")
	if err := os.WriteFile(bad, []byte("[server]\nsocket = \"/tmp/x.sock\"\nmax_clientz = 3\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	typo := filepath.Join(dir, "typo.toml")
	if err := os.WriteFile(typo, []byte("[policy]\nname = \"lruu\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	vendor := filepath.Join(dir, "vendor.toml")
	if err := os.WriteFile(vendor, []byte("[policy]\nname = \"/opt/vendor/policy.wasm\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	nogroup := filepath.Join(dir, "nogroup.toml")
	if err := os.WriteFile(nogroup, []byte("[server]\nsocket_group = \"kvhost-no-such-group\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	gid := filepath.Join(dir, "gid.toml")
	if err := os.WriteFile(gid, []byte("[server]\nsocket_group = \"2000\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name     string
		args     []string
		code     int
		stdout   string
		stderrIn []string
	}{
		{"example config is ok", []string{"check", good}, 0, good + ": ok", nil},
		{"a socket group the machine lacks fails as the daemon's start would", []string{"check", nogroup}, 1, "",
			[]string{nogroup, "server.socket_group", "kvhost-no-such-group", "would not start"}},
		{"a numeric socket group needs no group", []string{"check", gid}, 0, gid + ": ok", nil},
		{"unknown built-in policy named", []string{"check", typo}, 1, "", []string{typo, "policy.name", `"lruu"`, "built in: "}},
		{"a plugin file missing here is refused", []string{"check", vendor}, 1, "", []string{vendor + ":2", "policy.name", "no such file here", "check there"}},
		{"unknown key named with its line", []string{"check", bad}, 1, "", []string{bad + ":3", "server.max_clientz"}},
		{"missing file named", []string{"check", filepath.Join(dir, "nope.toml")}, 1, "", []string{"nope.toml"}},
		{"no file is a usage error", []string{"check"}, 2, "", []string{"usage"}},
		{"unknown subcommand", []string{"frobnicate"}, 2, "", []string{"frobnicate"}},
		{"--help prints the usage", []string{"--help"}, 0, "usage: kvhost config check FILE", nil},
		{"-h prints the usage", []string{"-h"}, 0, "usage: kvhost config check FILE", nil},
		{"check --help prints the usage", []string{"check", "--help"}, 0, "usage: kvhost config check FILE", nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			code := runConfig(context.Background(), c.args, &out, &errb)
			if code != c.code {
				t.Fatalf("exit %d, want %d (stdout %q, stderr %q)", code, c.code, out.String(), errb.String())
			}
			if !strings.Contains(out.String(), c.stdout) {
				t.Errorf("stdout %q, want it to contain %q", out.String(), c.stdout)
			}
			for _, s := range c.stderrIn {
				if !strings.Contains(errb.String(), s) {
					t.Errorf("stderr %q does not contain %q", errb.String(), s)
				}
			}
		})
	}
}

// TestOperatorCommandsTakeTheSocketFromConfig: stats, health and reload
// given only the daemon's --config file find its socket there (no
// --socket, and the socket is not the default one).
func TestOperatorCommandsTakeTheSocketFromConfig(t *testing.T) {
	file, socket, _ := testConfig(t, t.TempDir(), "")
	startProc(t, []string{"KVHOST_SOCKET="}, "--config", file)
	for _, args := range [][]string{
		{"stats", "--config", file},
		{"stats", "--json", "--config", file},
		{"health", "--config", file},
		{"reload", "--config", file},
	} {
		t.Run(strings.Join(args[:len(args)-2], " "), func(t *testing.T) {
			var out, errb bytes.Buffer
			if code := run(context.Background(), args, &out, &errb); code != 0 {
				t.Fatalf("kvhost %s: exit %d, stderr %s", strings.Join(args, " "), code, errb.String())
			}
			if args[0] == "stats" && !strings.Contains(out.String(), socket) {
				t.Errorf("kvhost %s does not show the socket %s:\n%s", strings.Join(args, " "), socket, out.String())
			}
		})
	}
	t.Run("--socket wins over --config", func(t *testing.T) {
		var out, errb bytes.Buffer
		bogus := filepath.Join(testsock.Dir(t), "none.sock")
		if code := run(context.Background(), []string{"health", "--config", file, "--socket", bogus}, &out, &errb); code != 1 || !strings.Contains(errb.String(), bogus) {
			t.Fatalf("exit %d, stderr %q: want 1 naming %s", code, errb.String(), bogus)
		}
	})
	t.Run("a bad file is a usage error", func(t *testing.T) {
		var out, errb bytes.Buffer
		missing := filepath.Join(t.TempDir(), "none.toml")
		if code := run(context.Background(), []string{"stats", "--config", missing}, &out, &errb); code != 2 || !strings.Contains(errb.String(), "none.toml") {
			t.Fatalf("exit %d, stderr %q: want 2 naming the file", code, errb.String())
		}
	})
}

// TestExampleConfigsUseTheDefaultSocket: the configurations under
// examples/ leave the socket at the default every client connects to
// when given none, so that a daemon started with one is found without
// setting KVHOST_SOCKET.
func TestExampleConfigsUseTheDefaultSocket(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("..", "..", "examples", "*.toml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no examples/*.toml (%v)", err)
	}
	t.Setenv("KVHOST_SOCKET", "")
	want := client.DefaultSocket()
	for _, f := range files {
		c, err := config.Load(f)
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		if c.Server.Socket != want {
			t.Errorf("%s: socket %s, want the clients' default %s", f, c.Server.Socket, want)
		}
	}
}

// TestGoClientExampleStoresAndLoadsThroughKVHOST_SOCKET builds
// examples/go-client from the checkout as the README says (go run
// ./examples/go-client) and runs it with only KVHOST_SOCKET naming the
// daemon's socket: it stores, finds and loads its key.
func TestGoClientExampleStoresAndLoadsThroughKVHOST_SOCKET(t *testing.T) {
	file, socket, _ := testConfig(t, t.TempDir(), "")
	startProc(t, nil, "--config", file)
	cmd := exec.Command(buildGoClientExample(t))
	cmd.Env = append(os.Environ(), "KVHOST_SOCKET="+socket)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go-client: %v\n%s", err, out)
	}
	if want := "store: stored\nlookup: 1\nload: loaded\n"; string(out) != want {
		t.Fatalf("go-client printed %q, want %q", out, want)
	}
}

// buildGoClientExample builds examples/go-client from the checkout and
// returns the binary's path.
func buildGoClientExample(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "go-client")
	build := exec.Command("go", "build", "-o", bin, "./examples/go-client")
	build.Dir = filepath.Join("..", "..")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./examples/go-client: %v\n%s", err, out)
	}
	return bin
}

// TestGoClientExampleSaysWhyItsStoreFailed: where the daemon cannot store
// the example's key (a mount with no room for it), the example exits 1
// naming the failed store and the daemon's reason, not a load that
// differs from what was stored.
func TestGoClientExampleSaysWhyItsStoreFailed(t *testing.T) {
	file, socket, _ := testConfig(t, t.TempDir(), "")
	startProc(t, nil, "--config", file, "--capacity", "4KiB")
	cmd := exec.Command(buildGoClientExample(t))
	cmd.Env = append(os.Environ(), "KVHOST_SOCKET="+socket)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("go-client: %v, want exit status 1\n%s", err, out)
	}
	for _, want := range []string{"store: failed\n", "go-client: store failed", "no space"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("go-client printed %q, want it to say %q", out, want)
		}
	}
	if strings.Contains(string(out), "differs") {
		t.Errorf("go-client printed %q: a store that failed is not a load that differs", out)
	}
}

// TestHelpCommandPrintsThatCommandsUsage: `kvhost help CMD` prints what
// `kvhost CMD --help` prints, for every command `kvhost --help` lists;
// `kvhost help` alone prints kvhost's usage, and an unknown command or
// more than one is a usage error (exit 2, stderr).
func TestHelpCommandPrintsThatCommandsUsage(t *testing.T) {
	for name := range commands() {
		var want, got, errb bytes.Buffer
		run(t.Context(), []string{name, "--help"}, &want, &errb)
		if code := run(t.Context(), []string{"help", name}, &got, &errb); code != 0 || got.String() != want.String() || errb.Len() != 0 {
			t.Errorf("kvhost help %s: exit %d, stdout %q, stderr %q; want exit 0 and kvhost %s --help's usage", name, code, got.String(), errb.String(), name)
		}
	}
	var top, errb bytes.Buffer
	run(t.Context(), []string{"--help"}, &top, &errb)
	for _, args := range [][]string{{"help"}, {"help", "--help"}, {"help", "-h"}, {"help", "help"}} {
		var alone bytes.Buffer
		if code := run(t.Context(), args, &alone, &errb); code != 0 || alone.String() != top.String() {
			t.Errorf("kvhost %s: exit %d, %q; want kvhost --help's usage", strings.Join(args, " "), code, alone.String())
		}
	}
	for _, args := range [][]string{{"help", "nosuch"}, {"help", "stats", "purge"}} {
		var out, errb bytes.Buffer
		if code := run(t.Context(), args, &out, &errb); code != 2 || out.Len() != 0 || errb.Len() == 0 {
			t.Errorf("kvhost %s: exit %d, stdout %q, stderr %q; want exit 2 and the error on stderr", strings.Join(args, " "), code, out.String(), errb.String())
		}
	}
}
