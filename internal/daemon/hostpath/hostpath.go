// Package hostpath builds the engine's CPU path, the mover of host
// memory (engine.Config.Host), from the staging pipeline: the one place
// beside the daemon's assembly that names it, for the assembly and for
// the tests and tools that open an engine outside the daemon.
package hostpath

import (
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/staging"
	"github.com/kvhost/kvhost/transfer"
)

// Staging is an engine.HostFactory: the staging pipeline (staging.Mover)
// of the engine's spec, its workers the engine's I/O workers.
func Staging(s engine.HostSpec) (engine.HostPath, error) {
	m, err := staging.NewMover(staging.Config{
		Workers:    s.Workers,
		CPUs:       s.CPUs,
		BufferSize: s.BufferSize,
		Buffers:    s.Buffers,
		YieldBytes: s.YieldBytes,
	})
	if err != nil {
		return nil, err
	}
	return path{m}, nil
}

// path is a staging.Mover as an engine.HostPath.
type path struct{ *staging.Mover }

// For returns the pipeline's mover for a mount opened with O_DIRECT
// (direct) or not.
func (p path) For(direct bool) transfer.Mover { return p.Mover.For(direct) }

// Buffers reports the pipeline's bounce buffers: in use, the most there
// may be, and their size.
func (p path) Buffers() (inUse, limit, size int) {
	b := p.Pool().Buffers()
	inUse, limit = b.Usage()
	return inUse, limit, b.Size()
}
