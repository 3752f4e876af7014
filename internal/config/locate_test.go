package config

import (
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
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
