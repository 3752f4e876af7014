package config

import (
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestLocateNamesWhereAKeysValueCameFrom: a fault of a key's value found
// past Load (the daemon's start) reads "config: FILE:LINE: KEY: ..." as
// the loader's own errors do, names the flag where one gave the value,
// and the key alone where neither did; it unwraps to the fault.
func TestLocateNamesWhereAKeysValueCameFrom(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "kvhost.toml")
	if err := os.WriteFile(file, []byte("# a node\n[server]\nsocket_group = \"nosuchgrp\"\n\n[policy]\nname = \"lruu\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	fault := errors.New("the fault; the fix")
	for _, tt := range []struct {
		name string
		args []string
		key  string
		want string
	}{
		{"file", []string{"--config", file}, "server.socket_group", "config: " + file + ":3: server.socket_group: the fault; the fix"},
		{"file, a later table", []string{"--config", file}, "policy.name", "config: " + file + ":6: policy.name: the fault; the fix"},
		{"flag over the file", []string{"--config", file, "--policy", "lruu"}, "policy.name", "config: policy.name (from --policy): the fault; the fix"},
		{"flag alone", []string{"--policy", "lruu"}, "policy.name", "config: policy.name (from --policy): the fault; the fix"},
		{"not in the file", []string{"--config", file}, "log.level", "config: " + file + ": log.level: the fault; the fix"},
		{"no file, no flag", nil, "server.socket_group", "config: server.socket_group: the fault; the fix"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			fs := flag.NewFlagSet("kvhost", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			f := BindFlags(fs)
			if err := fs.Parse(tt.args); err != nil {
				t.Fatal(err)
			}
			if _, err := f.Load(); err != nil {
				t.Fatal(err)
			}
			err := f.Locate(tt.key, fault)
			if err.Error() != tt.want {
				t.Errorf("got %q\nwant %q", err, tt.want)
			}
			var ke *KeyError
			if !errors.As(err, &ke) || ke.Key != tt.key || !errors.Is(err, fault) {
				t.Errorf("%v: want a *KeyError of %s wrapping the fault", err, tt.key)
			}
		})
	}
}

// TestAFlagsBadValueNamesTheFlag: a value out of range that a flag gave
// reads "config: KEY (from --FLAG): want ..., got ...", as
// docs/config.md says, not "(from the command line or -config)", which
// left the operator to find which of the two; a key no flag set is
// placed in the file, with the flags that made it fail.
func TestAFlagsBadValueNamesTheFlag(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "kvhost.toml")
	if err := os.WriteFile(file, []byte("[policy]\nshards = 2\n\n[[mount]]\npath = \"/tmp/a\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	tiered := filepath.Join(dir, "tiered.toml")
	if err := os.WriteFile(tiered, []byte("[policy]\nname = \"tiered\"\n[policy.params]\nhot = 0\ncold = 1\n[[mount]]\npath = \"/tmp/a\"\n[[mount]]\npath = \"/tmp/c\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name string
		args []string
		want string
	}{
		{"flag alone", []string{"--policy-shards", "100"}, "config: policy.shards (from --policy-shards): want between 0 (automatic) and 64, got 100"},
		{"flag over the file", []string{"--config", file, "--policy-shards", "100"}, "config: policy.shards (from --policy-shards): want between 0 (automatic) and 64, got 100"},
		{"io workers", []string{"--io-workers", "-3"}, "config: engine.io_workers (from --io-workers): want between 0 (automatic) and 256, got -3"},
		{"the file's key after a flag", []string{"--config", tiered, "--dir", "/tmp/b"},
			"config: " + tiered + ":5: policy.params.cold: want a mount index from 0 to 0 (the tiered policy's cold mount; 1 mount is configured), got 1 (with --dir)"},
		{"log level", []string{"--log-level", "loud"}, "config: log.level (from --log-level): "},
	} {
		t.Run(tt.name, func(t *testing.T) {
			fs := flag.NewFlagSet("kvhost", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			f := BindFlags(fs)
			if err := fs.Parse(tt.args); err != nil {
				t.Fatal(err)
			}
			_, err := f.Load()
			if err == nil || !strings.HasPrefix(err.Error(), tt.want) || strings.Contains(err.Error(), "command line or -config") {
				t.Fatalf("got %v\nwant %q...", err, tt.want)
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("%v: want errors.Is ErrInvalid", err)
			}
		})
	}
}
