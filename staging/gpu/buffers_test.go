package gpu

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestFreeBuffersHandOutTheOneReturnedLastAndMakeTakersWait(t *testing.T) {
	ctx := context.Background()
	f := newFreeBuffers(3)
	var got []int
	for range 3 {
		i, ok, err := f.take(ctx, false)
		if !ok || err != nil {
			t.Fatalf("take from a list with free buffers: %v %v", ok, err)
		}
		got = append(got, i)
	}
	if _, ok, _ := f.take(ctx, false); ok || f.free() != 0 {
		t.Fatal("a take without waiting got a buffer from an empty list")
	}
	f.put(got[0])
	f.put(got[2])
	if i, _, _ := f.take(ctx, false); i != got[2] {
		t.Fatalf("took %d, want %d, the one returned last", i, got[2])
	}
	if i, _, _ := f.take(ctx, false); i != got[0] {
		t.Fatalf("took %d, want %d", i, got[0])
	}
	done := make(chan int)
	go func() {
		i, _, err := f.take(ctx, true)
		if err != nil {
			i = -1
		}
		done <- i
	}()
	f.put(got[1])
	if i := <-done; i != got[1] {
		t.Fatalf("a waiting take got %d, want %d", i, got[1])
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
	defer cancel()
	if _, ok, err := f.take(cctx, true); ok || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a waiting take on an empty list past its deadline: %v %v", ok, err)
	}
	if f.total() != 3 {
		t.Fatalf("total %d, want 3", f.total())
	}
}

func TestPinnedUsageCountsTheBuffersJobsHold(t *testing.T) {
	e := newEnv(t)
	m := e.mover(t, Config{Devices: []int{0}, MaxStaging: 4 << 20, Chunk: 1 << 20})
	inUse, total, size := m.PinnedUsage()
	if inUse != 0 || total < 2 || size < 1<<20 || int64(total*size) > 4<<20 {
		t.Fatalf("idle: %d in use of %d buffers of %d bytes; want 0 of at least 2 of a chunk or more, within 4 MiB", inUse, total, size)
	}
	i, ok, err := m.bufs.take(context.Background(), true)
	if err != nil || !ok {
		t.Fatalf("take: %v %v", ok, err)
	}
	if got, _, _ := m.PinnedUsage(); got != 1 {
		t.Errorf("one buffer taken: %d in use", got)
	}
	m.bufs.put(i)
	if got, _, _ := m.PinnedUsage(); got != 0 {
		t.Errorf("given back: %d in use", got)
	}
}
