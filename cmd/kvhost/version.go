package main

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"

	"github.com/kvhost/kvhost/internal/cuda"
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

func runVersion(_ context.Context, _ []string, stdout, _ io.Writer) int {
	fmt.Fprintln(stdout, versionString())
	return 0
}
