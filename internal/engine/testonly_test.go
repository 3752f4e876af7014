//go:build invariants

package engine

import (
	"context"
	"errors"
	"strings"

	"github.com/kvhost/kvhost/internal/engine/accesslog"
	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/staging"
	"github.com/kvhost/kvhost/transfer"
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

// testOpen is Open with the staging pipeline as the CPU path where cfg
// names none (the daemon's, internal/daemon/hostpath, which imports the
// engine and so cannot be the engine's tests').
func testOpen(ctx context.Context, cfg Config) (*Engine, error) {
	if cfg.Host == nil {
		cfg.Host = stagingHost
	}
	return Open(ctx, cfg)
}

// stagingHost is hostpath.Staging, for the engine's tests.
func stagingHost(s HostSpec) (HostPath, error) {
	m, err := staging.NewMover(staging.Config{Workers: s.Workers, CPUs: s.CPUs, BufferSize: s.BufferSize, Buffers: s.Buffers, YieldBytes: s.YieldBytes})
	if err != nil {
		return nil, err
	}
	return stagingPath{m}, nil
}

// stagingPath is a staging.Mover as a HostPath.
type stagingPath struct{ *staging.Mover }

func (p stagingPath) For(direct bool) transfer.Mover { return p.Mover.For(direct) }

func (p stagingPath) Buffers() (inUse, limit, size int) {
	b := p.Pool().Buffers()
	inUse, limit = b.Usage()
	return inUse, limit, b.Size()
}
