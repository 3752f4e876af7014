package main

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"

	"github.com/kvhost/kvhost/cuda"
)

// version is the release the binary was built from; the Makefile sets it
// with -ldflags "-X main.version=...". Builds without it report the module
// version and VCS revision that Go recorded.
var version = ""

// versionString describes the build: release (or module version), VCS
// revision and whether the tree was modified, Go version.
func versionString() string {
	v, rev, dirty := version, "", false
	if bi, ok := debug.ReadBuildInfo(); ok {
		if v == "" {
			v = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
	}
	if v == "" || v == "(devel)" {
		v = "devel"
	}
	s := "kvhost " + v
	if rev != "" {
		if len(rev) > 12 {
			rev = rev[:12]
		}
		s += " (" + rev
		if dirty {
			s += ", modified"
		}
		s += ")"
	}
	s += " " + runtime.Version() + " " + runtime.GOOS + "/" + runtime.GOARCH
	if !gpuBuild {
		s += " (" + cpuOnlyNote + ")"
	}
	return s
}

// gpuBuild is whether this binary can load CUDA (cuda.Loadable); a
// variable so that tests can play a build without cgo.
var gpuBuild = cuda.Loadable

// cpuOnlyNote says what a build without cgo is, in `kvhost version` and
// `kvhost check`.
const cpuOnlyNote = "CPU only: built without cgo, so it cannot load CUDA; serves host memory only"

// versionUsage describes `kvhost version`.
const versionUsage = `usage: kvhost version

Prints the binary's release (or module version), its VCS revision, the Go
version and platform it was built with, and whether it was built without
cgo (CPU only). It takes no flags.`

// runVersion implements `kvhost version` (and `kvhost --version`, which
// passes what follows it): it parses its arguments as every command does
// (parseFlagsOnly: --help prints its usage whatever follows it, and any
// other argument is a usage error rather than ignored).
func runVersion(_ context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("kvhost version", versionUsage, stderr)
	if code, ok := parseFlagsOnly(fs, args, stdout, stderr); !ok {
		return code
	}
	fmt.Fprintln(stdout, versionString())
	return 0
}
