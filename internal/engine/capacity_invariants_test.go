//go:build invariants

package engine

import (
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/testwait"
)

// The tests here hold the index's lock from outside it (index.Block),
// which only the invariants build has.

// An eviction where no file's removal failed, the common case, does not
// take the index's lock to try them again (retryLeft): the lock is the
// one lookups, loads and stores take, and an eviction comes as often as
// stores cross the high watermark.
func TestAnEvictionWithNoFileLeftDoesNotLockTheIndexToRetryOne(t *testing.T) {
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor)})
	unlock := sync.OnceFunc(e.ix.Block())
	t.Cleanup(unlock) // before the engine's Close, which needs the lock
	var done atomic.Bool
	go func() {
		e.rm.retryLeft(e.mounts[0])
		done.Store(true)
	}()
	testwait.Until(t, "retryLeft with no file left to return while the index is locked", testwait.Hang, done.Load)
	unlock()
}
