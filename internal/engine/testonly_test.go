//go:build invariants

package engine

import (
	"errors"
	"strings"

	"github.com/kvhost/kvhost/internal/engine/accesslog"
	"github.com/kvhost/kvhost/internal/engine/index"
)

// What only the engine's tests use of its code: built, as they are, with
// -tags invariants.

// keyID is the index's key, as the tests name it.
type keyID = index.KeyID

// isJournal reports whether name (a file under a mount's root) is an
// access journal, or a compaction's temporary file of one.
func isJournal(name string) bool {
	return strings.HasPrefix(name, accesslog.Prefix)
}

// check returns the first broken invariant of the engine's parts: the
// index's, the space's, and, where no job holds a path, that each
// mount's room holds exactly its indexed files. Tests call it.
func (e *Engine) check() error {
	return errors.Join(e.ix.Check(), e.space.Check(), e.ix.CheckAtRest(e.space.Mounts(), e.space.UsageAtRest))
}
