package config

import (
	"errors"
	"flag"
	"fmt"
	"path/filepath"
	"strings"
)

// Flags are the command-line settings that override the configuration file.
type Flags struct {
	fs         *flag.FlagSet
	configPath string
	policy     string
	socket     string
	dir        string
	capacity   Size
	prealloc   AutoSize
	logLevel   string
	logFormat  string
	fsync      bool
	ioWorkers  int
	shards     int
	metrics    string
}

// BindFlags registers kvhost's common settings on fs.
func BindFlags(fs *flag.FlagSet) *Flags {
	f := &Flags{fs: fs}
	fs.StringVar(&f.configPath, "config", "", "TOML configuration `file` (flags override it)")
	fs.StringVar(&f.policy, "policy", "", "placement policy: a built-in `name` (lru, lfu, ttl, sharded; tiered for several mounts) or a .wasm file")
	fs.StringVar(&f.socket, "socket", "", "Unix socket `path` clients connect to")
	fs.StringVar(&f.dir, "dir", "", "cache `directory` (replaces the configured mounts with this one)")
	fs.Var(&f.capacity, "capacity", "bytes to store under -dir, or under every configured mount without -dir, e.g. 100GiB (0: 90% of the file system)")
	fs.Var(&f.prealloc, "preallocate", "bytes of spare files to make ahead of stores on every memory-file-system mount, e.g. 4GiB (0: none; auto, the default: an eighth of the mount's capacity, at most the larger of 4GiB and a sixteenth of memory)")
	fs.StringVar(&f.logLevel, "log-level", "", "debug, info, warn or error")
	fs.StringVar(&f.logFormat, "log-format", "", "auto, text or json")
	fs.BoolVar(&f.fsync, "fsync", false, "make every store durable before it completes")
	fs.IntVar(&f.ioWorkers, "io-workers", 0, "I/O worker threads (0: automatic)")
	fs.IntVar(&f.shards, "policy-shards", 0, "plugin instances the policy state is spread over")
	fs.StringVar(&f.metrics, "metrics", "", "serve Prometheus metrics and health probes on this TCP `address` (e.g. 127.0.0.1:9400)")
	return f
}

// ConfigPath is the value of -config.
func (f *Flags) ConfigPath() string { return f.configPath }

// Load reads the file named by -config (or starts from Default), applies the
// flags that were set, and validates the result.
func (f *Flags) Load() (Config, error) {
	c := Default()
	if f.configPath != "" {
		var err error
		if c, err = Load(f.configPath); err != nil {
			return Config{}, err
		}
	}
	if err := f.Apply(&c); err != nil {
		return Config{}, err
	}
	return c, nil
}

// Apply copies every flag that was set on the command line onto c (the
// -dir path made absolute against the working directory; a relative
// -socket kept as given, to be bound against it) and validates the
// result.
func (f *Flags) Apply(c *Config) error {
	var err error
	f.fs.Visit(func(fl *flag.Flag) {
		switch fl.Name {
		case "policy":
			c.Policy.Name = f.policy
		case "socket":
			c.Server.Socket = f.socket
		case "dir":
			abs, aerr := filepath.Abs(f.dir)
			if aerr != nil {
				err = invalidf("-dir %q: %v", f.dir, aerr)
				return
			}
			c.Mounts = []Mount{{Path: abs, HighWatermark: 0.95, LowWatermark: 0.85}}
		case "log-level":
			c.Log.Level = f.logLevel
		case "log-format":
			c.Log.Format = f.logFormat
		case "fsync":
			c.Engine.Fsync = f.fsync
		case "io-workers":
			c.Engine.IOWorkers = f.ioWorkers
		case "policy-shards":
			c.Policy.Shards = f.shards
		case "metrics":
			c.Metrics.Listen = f.metrics
		}
	})
	if err != nil {
		return err
	}
	f.fs.Visit(func(fl *flag.Flag) {
		switch fl.Name {
		case "capacity":
			for i := range c.Mounts {
				c.Mounts[i].Capacity = f.capacity
			}
		case "preallocate":
			for i := range c.Mounts {
				c.Mounts[i].Preallocate = f.prealloc
			}
		}
	})
	if err := c.Validate(); err != nil {
		return f.place(err)
	}
	return nil
}

// place names where a value that Validate refuses after Apply came from,
// as docs/config.md says every error about a value does: the flag that
// set its key ("config: KEY (from --FLAG): ..."), else the file and the
// line of the key ("config: FILE:LINE: KEY: ..."), with the flags given,
// since the file alone passed Load's checks (--dir leaves the tiered
// policy's cold mount pointing past the one mount, say).
func (f *Flags) place(err error) error {
	var ve *ValueError
	if !errors.As(err, &ve) {
		return fmt.Errorf("%w (from the command line or --config)", err)
	}
	fault := fmt.Errorf("want %s, got %v", ve.Want, ve.Got)
	var set []string
	flagged := false
	f.fs.Visit(func(fl *flag.Flag) {
		if fl.Name != "config" {
			set = append(set, "--"+fl.Name)
		}
		flagged = flagged || fl.Name == flagOf(ve.Key)
	})
	if flagged {
		return &KeyError{Key: ve.Key, Flag: "--" + flagOf(ve.Key), Err: fault}
	}
	if len(set) > 0 {
		fault = fmt.Errorf("%w (with %s)", fault, strings.Join(set, ", "))
	}
	return AtKey(f.configPath, ve.Key, ve.Mount, fault)
}

// Locate returns err, a fault of key's value in the configuration the
// last Load returned, as a *KeyError naming key and where its value came
// from: the flag that set it, else the configuration file and the line in
// it that sets key (of the first [[mount]] for a mount's key). A nil f
// (no flags were parsed: the checks build what the start builds) returns
// err as it is, for the caller to place.
func (f *Flags) Locate(key string, err error) error {
	if f == nil {
		return err
	}
	ke := &KeyError{Key: key, Err: err}
	if name := flagOf(key); name != "" {
		f.fs.Visit(func(fl *flag.Flag) {
			if fl.Name == name {
				ke.Flag = "--" + name
			}
		})
		if ke.Flag != "" {
			return ke
		}
	}
	return AtKey(f.configPath, key, 0, err)
}

// flagOf is the name of the flag that sets key, or "" for none.
func flagOf(key string) string {
	switch key {
	case "policy.name":
		return "policy"
	case "server.socket":
		return "socket"
	case "mount.path":
		return "dir"
	case "mount.capacity":
		return "capacity"
	case "mount.preallocate":
		return "preallocate"
	case "log.level":
		return "log-level"
	case "log.format":
		return "log-format"
	case "engine.fsync":
		return "fsync"
	case "engine.io_workers":
		return "io-workers"
	case "policy.shards":
		return "policy-shards"
	case "metrics.listen":
		return "metrics"
	}
	return ""
}
