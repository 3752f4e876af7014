package main

import (
	"bytes"
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/testsock"
)

// TestSubcommandFlagHandling checks the shared flag handling of the
// subcommands: --help prints the usage and the flags on stdout and exits
// 0, a bad flag exits 2, and a stray positional argument exits 2 (naming
// it) where the command takes none.
func TestSubcommandFlagHandling(t *testing.T) {
	cmds := []struct {
		name  string
		run   func(ctx context.Context, args []string, stdout, stderr io.Writer) int
		usage string
		flag  string // a flag the command defines, shown by --help
	}{
		{"health", runHealth, "usage: kvhost health", "-allow-fallback"},
		{"stats", runStats, "usage: kvhost stats", "-json"},
		{"reload", runReload, "usage: kvhost reload", "-timeout"},
		{"check", runCheck, "usage: kvhost check", "-speed"},
		{"serve", runServe, "usage: kvhost [serve]", "-config"},
	}
	for _, c := range cmds {
		t.Run(c.name+"/help", func(t *testing.T) {
			var out, errb bytes.Buffer
			if code := c.run(t.Context(), []string{"--help"}, &out, &errb); code != 0 {
				t.Fatalf("--help: exit %d, want 0; stderr:\n%s", code, errb.String())
			}
			for _, want := range []string{c.usage, "\n\nflags:\n", c.flag} {
				if !strings.Contains(out.String(), want) {
					t.Errorf("--help output lacks %q:\n%s", want, out.String())
				}
			}
		})
		t.Run(c.name+"/bad flag", func(t *testing.T) {
			var out, errb bytes.Buffer
			if code := c.run(t.Context(), []string{"--no-such-flag"}, &out, &errb); code != 2 {
				t.Fatalf("bad flag: exit %d, want 2; stderr:\n%s", code, errb.String())
			}
			if !strings.Contains(errb.String(), "no-such-flag") {
				t.Errorf("stderr does not name the bad flag:\n%s", errb.String())
			}
		})
	}
	// None of them takes a positional argument. A stray one is refused
	// before anything runs: the commands that talk to a daemon would
	// otherwise ask the default socket's (a socket path given without
	// --socket), drop the flags after it ("stray --json"), or take
	// "--allow-fallback false" for --allow-fallback and ignore "false".
	for _, c := range cmds {
		t.Run(c.name+"/stray argument", func(t *testing.T) {
			var out, errb bytes.Buffer
			if code := c.run(t.Context(), []string{"stray", "--json"}, &out, &errb); code != 2 {
				t.Fatalf("stray argument: exit %d, want 2; stderr:\n%s", code, errb.String())
			}
			if want := `kvhost ` + c.name + `: unexpected argument "stray"`; !strings.Contains(errb.String(), want) {
				t.Errorf("stderr lacks %q:\n%s", want, errb.String())
			}
		})
	}
	t.Run("health/bool flag given a separate value", func(t *testing.T) {
		var out, errb bytes.Buffer
		if code := runHealth(t.Context(), []string{"--allow-fallback", "false"}, &out, &errb); code != 2 {
			t.Fatalf("--allow-fallback false: exit %d, want 2; stderr:\n%s", code, errb.String())
		}
		if want := `kvhost health: unexpected argument "false"`; !strings.Contains(errb.String(), want) {
			t.Errorf("stderr lacks %q:\n%s", want, errb.String())
		}
	})
}

// TestOperatorCommandsSayASocketIsNotAKvhostDaemons: stats, health and
// reload pointed at a socket whose listener answers their Hello with
// something else (an HTTP server's reply) fail at once (exit 1) saying
// that the socket is not a kvhost daemon's, and which socket it is.
func TestOperatorCommandsSayASocketIsNotAKvhostDaemons(t *testing.T) {
	socket := filepath.Join(testsock.Dir(t), "http.sock")
	ln, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				io.WriteString(conn, "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
				io.Copy(io.Discard, conn)
			}()
		}
	}()
	for _, cmd := range []string{"stats", "health", "reload"} {
		t.Run(cmd, func(t *testing.T) {
			var out, errb bytes.Buffer
			if code := run(t.Context(), []string{cmd, "--socket", socket}, &out, &errb); code != 1 {
				t.Fatalf("exit %d, want 1; stderr:\n%s", code, errb.String())
			}
			for _, want := range []string{socket, "not a kvhost daemon"} {
				if !strings.Contains(errb.String(), want) {
					t.Errorf("stderr lacks %q:\n%s", want, errb.String())
				}
			}
		})
	}
}

// TestAnUnknownCommandIsNamedAsOne: a first word that is no command and no
// flag ("kvhost stat") is refused as an unknown command, in a few lines
// that name the command likely meant and list the commands (not the 50
// lines of the whole usage), not taken for a stray argument of serve (the
// default command); `kvhost help NAME` says the same.
func TestAnUnknownCommandIsNamedAsOne(t *testing.T) {
	tests := []struct {
		args  []string
		wants []string
	}{
		{[]string{"stat", "--json"}, []string{`kvhost: unknown command "stat" (did you mean "stats"?)`, "\ncommands: ", "stats", "kvhost --help"}},
		{[]string{"relaod"}, []string{`kvhost: unknown command "relaod" (did you mean "reload"?)`}},
		{[]string{"frobnicate"}, []string{`kvhost: unknown command "frobnicate"` + "\n"}},
		{[]string{"help", "stat"}, []string{`kvhost help: unknown command "stat" (did you mean "stats"?)`}},
	}
	for _, tt := range tests {
		var out, errb bytes.Buffer
		if code := run(t.Context(), tt.args, &out, &errb); code != 2 {
			t.Fatalf("kvhost %q: exit %d, want 2; stderr:\n%s", tt.args, code, errb.String())
		}
		for _, want := range tt.wants {
			if !strings.Contains(errb.String(), want) {
				t.Errorf("kvhost %q: stderr lacks %q:\n%s", tt.args, want, errb.String())
			}
		}
		if n := strings.Count(errb.String(), "\n"); n > 4 {
			t.Errorf("kvhost %q: %d lines for an unknown command, want at most 4:\n%s", tt.args, n, errb.String())
		}
	}
}

// TestDaemonFlagsReadOnlyTheSocketFromConfig: stats, health and reload
// need only server.socket of the daemon's --config file: a file with
// errors elsewhere gives its socket (or the default one where it names
// none) with a warning on stderr that names the error; a file whose
// socket cannot be read (missing, not TOML, a socket of the wrong type)
// ends the command with exit 2.
func TestDaemonFlagsReadOnlyTheSocketFromConfig(t *testing.T) {
	dir := testsock.Dir(t)
	write := func(name, src string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	sock := filepath.Join(dir, "d.sock")
	def := config.Default().Server.Socket
	tests := []struct {
		name     string
		file     string
		code     int
		socket   string
		stderrIn []string // "" for none
	}{
		{"a valid file", write("ok.toml", "[server]\nsocket = \""+sock+"\"\n"), 0, sock, nil},
		{"an unknown key elsewhere", write("unknown.toml", "[server]\nsocket = \""+sock+"\"\n[engine]\nbogus = 1\n"), 0, sock,
			[]string{"warning", "unknown key \"engine.bogus\"", sock}},
		{"a bad value elsewhere", write("value.toml", "[policy]\nshards = 65\n[server]\nsocket = \""+sock+"\"\n"), 0, sock,
			[]string{"warning", "policy.shards"}},
		{"no socket and an error elsewhere", write("nosock.toml", "[policy]\nshards = 65\n"), 0, def, []string{"warning", "policy.shards"}},
		{"a socket of the wrong type", write("type.toml", "[server]\nsocket = 5\n"), 2, "", []string{"server.socket"}},
		{"not TOML", write("syntax.toml", "[server\nsocket = \"x\"\n"), 2, "", []string{"syntax.toml"}},
		{"a missing file", filepath.Join(dir, "none.toml"), 2, "", []string{"none.toml"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var errb bytes.Buffer
			fs := newFlagSet("kvhost stats", "usage", &errb)
			df := bindDaemonFlags(fs, time.Second, "")
			code, ok := df.parse(fs, []string{"--config", tt.file}, io.Discard, &errb)
			if code != tt.code || ok != (tt.code == 0) {
				t.Fatalf("parse: exit %d (ok %v), want %d; stderr %q", code, ok, tt.code, errb.String())
			}
			if ok && *df.socket != tt.socket {
				t.Errorf("socket %q, want %q", *df.socket, tt.socket)
			}
			if tt.stderrIn == nil && errb.Len() != 0 {
				t.Errorf("stderr %q, want nothing", errb.String())
			}
			for _, s := range tt.stderrIn {
				if !strings.Contains(errb.String(), s) {
					t.Errorf("stderr %q does not contain %q", errb.String(), s)
				}
			}
		})
	}
}
