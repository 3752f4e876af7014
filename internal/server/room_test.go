package server

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/testwait"
)

// waitersNow is the number of takes waiting for r.
func (r *room) waitersNow() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.waiters.Len()
}

// TestRoomServesTakesInOrder: a take that fits does not wait; one that
// does not waits until enough is given back, and a later take that would
// fit does not pass it.
func TestRoomServesTakesInOrder(t *testing.T) {
	r := &room{size: 10}
	ctx := context.Background()
	if waited, err := r.take(ctx, 6); waited || err != nil {
		t.Fatalf("a take of 6 of 10: waited %v, %v", waited, err)
	}
	got := make(chan int64, 2)
	take := func(n int64) {
		if _, err := r.take(ctx, n); err != nil {
			t.Error(err)
		}
		got <- n
	}
	go take(8)
	testwait.Until(t, "the take of 8 to wait", time.Minute, func() bool { return r.waitersNow() == 1 })
	go take(2)
	// The take of 2 would fit (6 of 10 are taken), but waits its turn.
	testwait.Until(t, "the take of 2 to wait behind it", time.Minute, func() bool { return r.waitersNow() == 2 })
	if used := r.taken(); used != 6 {
		t.Fatalf("%d taken with the take of 8 waiting, want 6: a later take passed it", used)
	}
	r.give(6)
	<-got
	<-got
	if used := r.taken(); used != 10 {
		t.Errorf("%d taken, want 10", used)
	}
}

// TestRoomTakeEndsWithItsContext: a take whose context ends while it
// waits takes nothing and returns the context's error, and the takes
// behind it are served if they fit.
func TestRoomTakeEndsWithItsContext(t *testing.T) {
	r := &room{size: 10}
	if _, err := r.take(context.Background(), 5); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ended := make(chan error, 1)
	go func() { _, err := r.take(ctx, 8); ended <- err }()
	testwait.Until(t, "the take of 8 to wait", time.Minute, func() bool { return r.waitersNow() == 1 })
	served := make(chan error, 1)
	go func() { _, err := r.take(context.Background(), 4); served <- err }()
	testwait.Until(t, "the take of 4 to wait behind it", time.Minute, func() bool { return r.waitersNow() == 2 })
	cancel()
	if err := <-ended; !errors.Is(err, context.Canceled) {
		t.Fatalf("the cancelled take: %v, want %v", err, context.Canceled)
	}
	if err := <-served; err != nil {
		t.Fatalf("the take behind the cancelled one: %v", err)
	}
	if used := r.taken(); used != 9 {
		t.Errorf("%d taken, want 9 (the cancelled take took nothing)", used)
	}
}
