package engine

import (
	"github.com/kvhost/kvhost/internal/engine/cluster"
	"github.com/kvhost/kvhost/internal/engine/index"
	"github.com/kvhost/kvhost/internal/engine/space"
)

// The index part's types, as the engine's files name them.
type (
	entry      = index.Entry
	flight     = index.Flight
	readMark   = index.ReadMark
	pinnedFile = index.PinnedFile
)

const (
	adoptIndexed = index.AdoptIndexed
	adoptHeld    = index.AdoptHeld
	adoptLeft    = index.AdoptLeft
)

// The space part's types, as the engine's files name them.
type (
	mountSpace = space.Mount
	spareFile  = space.Spare
)

// The cluster part's types, as the engine's files name them.
type (
	clusterMount = cluster.Mount
	clusterLoops = cluster.Run
)
