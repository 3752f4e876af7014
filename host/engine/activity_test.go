package engine

import (
	"context"
	"testing"
	"time"
)

// TestActivityShowsAHeldJobAndMovesOnlyAsWorkEnds: a store held in its
// mover's write is in Activity (one job, begun when it was submitted)
// and Moved stays put while it is held; once it goes on, Moved grows and
// no job is left. A watchdog tells a stalled engine from a busy one by
// these.
func TestActivityShowsAHeldJobAndMovesOnlyAsWorkEnds(t *testing.T) {
	held, release := make(chan struct{}), make(chan struct{})
	env := openRemovalEnv(t, Mount{Path: t.TempDir()}, func(ctx context.Context, n int) error {
		if n == 0 {
			close(held)
			<-release
		}
		return nil
	})
	before := env.e.Activity()
	if before.Jobs != 0 || !before.Oldest.IsZero() {
		t.Fatalf("idle engine: %+v", before)
	}
	submitted := time.Now()
	job, err := env.e.Store(context.Background(), StoreRequest{Cache: env.cid, Keys: [][]byte{[]byte("held")}, Blocks: [][]int{{0, 1, 2, 3}}})
	if err != nil {
		t.Fatal(err)
	}
	<-held
	during := env.e.Activity()
	if during.Jobs != 1 || during.Oldest.Before(submitted.Add(-time.Second)) || during.Oldest.After(time.Now()) {
		t.Errorf("a store held in its write: %+v (submitted %s)", during, submitted)
	}
	if during.Moved != before.Moved {
		t.Errorf("Moved went from %d to %d while the only job was held", before.Moved, during.Moved)
	}
	close(release)
	if res, err := job.Wait(context.Background()); err != nil || res.Keys[0].Outcome != OutcomeStored {
		t.Fatalf("the store: %+v, %v", res, err)
	}
	after := env.e.Activity()
	if after.Jobs != 0 || after.Moved <= during.Moved {
		t.Errorf("after the store ended: %+v (Moved was %d)", after, during.Moved)
	}
}
