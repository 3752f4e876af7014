// Package testwasm shares compiled wasm policies among the tests of one
// run. Compiling a Go-built plugin took 10 to 30 s under the race
// detector on 2 cores, and every test package that opens a built-in
// plugin would compile it again; `make test` names one directory for
// the whole run in the environment variable Env and fills it, without
// the race detector, before the race tests start. The compiled code
// does not depend on the race detector: wazero writes it, not Go.
package testwasm

import (
	"os"

	"github.com/tetratelabs/wazero"
)

// Env names the environment variable that holds the run's directory.
const Env = "KVHOST_TEST_WASM_CACHE"

// Dir returns the run's directory of compiled plugins, or "" where the
// run names none (a plain go test).
func Dir() string { return os.Getenv(Env) }

// Cache returns a compilation cache in Dir, or in memory where Dir is ""
// or cannot be opened: a cache only saves time, and a test that needs
// one of its own makes it.
func Cache() wazero.CompilationCache {
	if d := Dir(); d != "" {
		if c, err := wazero.NewCompilationCacheWithDir(d); err == nil {
			return c
		}
	}
	return wazero.NewCompilationCache()
}
