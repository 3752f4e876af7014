package removals

import (
	"context"
	"errors"
	"fmt"
	"testing"
)

// keys publishes n records of namespace fp named prefix0..prefix(n-1).
func keys(f *Feed, fp uint64, prefix string, n int) {
	for i := range n {
		f.Publish(Record{FP: fp, Key: fmt.Sprintf("%s%d", prefix, i), Reason: Evicted, To: NoMount})
	}
}

// drain reads every record s has now: Next with a context already
// cancelled returns what there is, and the context's error once nothing
// is left.
func drain(t *testing.T, s *Subscription) (recs []Record, resync bool) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for {
		b, err := s.Next(ctx, 3)
		if errors.Is(err, context.Canceled) {
			return recs, resync
		}
		if err != nil {
			t.Fatal(err)
		}
		resync = resync || b.Resync
		recs = append(recs, b.Records...)
	}
}

func TestPublishBeforeAnySubscriptionRecordsNothing(t *testing.T) {
	var f Feed
	keys(&f, 1, "k", 5)
	if st := f.Stats(); st.Published != 0 || st.Head != 0 {
		t.Fatalf("stats before a subscription: %+v", st)
	}
}

func TestSubscribeSinceGetsMissedRecordsOrResync(t *testing.T) {
	for _, tc := range []struct {
		name       string
		since      func(epoch, head uint64) (uint64, uint64)
		wantResync bool
		wantKeys   int // records of namespace 1 read
		wantErr    error
	}{
		{"first subscription: from now on", func(e, h uint64) (uint64, uint64) { return 0, 0 }, false, 0, nil},
		{"recent since: exactly the records missed", func(e, h uint64) (uint64, uint64) { return e, h - 3 }, false, 3, nil},
		{"since at the head: none", func(e, h uint64) (uint64, uint64) { return e, h }, false, 0, nil},
		{"since older than the ring: resync", func(e, h uint64) (uint64, uint64) { return e, 1 }, true, 0, nil},
		{"another epoch (a restarted daemon): resync", func(e, h uint64) (uint64, uint64) { return e + 1, h }, true, 0, nil},
		{"since without an epoch: resync", func(e, h uint64) (uint64, uint64) { return 0, h }, true, 0, nil},
		{"since past the head: refused", func(e, h uint64) (uint64, uint64) { return e, h + 1 }, false, 0, ErrFuture},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var f Feed
			if err := f.SetSize(8); err != nil {
				t.Fatal(err)
			}
			first, epoch, _, err := f.Subscribe(nil, 0, 0)
			if err != nil {
				t.Fatal(err)
			}
			first.Close()
			keys(&f, 1, "k", 20) // the ring keeps the last 8
			e, since := tc.since(epoch, f.Stats().Head)
			s, gotEpoch, head, err := f.Subscribe([]uint64{1}, e, since)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("Subscribe: %v, want %v", err, tc.wantErr)
			}
			if err != nil {
				return
			}
			defer s.Close()
			if gotEpoch != epoch || head != 20 {
				t.Fatalf("epoch %d head %d, want %d 20", gotEpoch, head, epoch)
			}
			recs, resync := drain(t, s)
			if resync != tc.wantResync || len(recs) != tc.wantKeys {
				t.Fatalf("resync %v, %d records; want %v, %d", resync, len(recs), tc.wantResync, tc.wantKeys)
			}
			for i, r := range recs {
				if want := uint64(20 - tc.wantKeys + i + 1); r.Seq != want {
					t.Fatalf("record %d has seq %d, want %d", i, r.Seq, want)
				}
			}
		})
	}
}

func TestSubscriptionReadsOnlyItsNamespaces(t *testing.T) {
	var f Feed
	s, _, _, err := f.Subscribe([]uint64{7}, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	keys(&f, 1, "other", 4)
	keys(&f, 7, "mine", 2)
	keys(&f, 1, "other", 4)
	recs, resync := drain(t, s)
	if resync || len(recs) != 2 || recs[0].Key != "mine0" || recs[1].Key != "mine1" {
		t.Fatalf("resync %v, records %+v; want mine0, mine1", resync, recs)
	}
}

func TestSlowSubscriberGetsResyncAndDoesNotBlockPublish(t *testing.T) {
	var f Feed
	if err := f.SetSize(16); err != nil {
		t.Fatal(err)
	}
	slow, _, _, err := f.Subscribe(nil, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	// The slow subscriber reads nothing while 100 times its ring is
	// published: Publish returns (the test would hang otherwise).
	keys(&f, 1, "k", 1600)
	b, err := slow.Next(context.Background(), 100)
	if err != nil || !b.Resync || b.Last != 1600 {
		t.Fatalf("first batch %+v, %v: want a resync at 1600", b, err)
	}
	keys(&f, 1, "after", 2)
	recs, resync := drain(t, slow)
	if resync || len(recs) != 2 || recs[0].Seq != 1601 {
		t.Fatalf("after the resync: resync %v, records %+v", resync, recs)
	}
	if st := f.Stats(); st.Resyncs != 1 || st.Subscribers != 1 || st.Published != 1602 {
		t.Fatalf("stats %+v", st)
	}
}

func TestNextEndsWithContextAndClose(t *testing.T) {
	var f Feed
	s, _, _, err := f.Subscribe(nil, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := s.Next(ctx, 1); !errors.Is(err, context.Canceled) {
		t.Fatalf("Next with a cancelled context: %v", err)
	}
	f.Close()
	if _, err := s.Next(context.Background(), 1); !errors.Is(err, ErrClosed) {
		t.Fatalf("Next on a closed feed: %v", err)
	}
	if _, _, _, err := f.Subscribe(nil, 0, 0); !errors.Is(err, ErrClosed) {
		t.Fatalf("Subscribe on a closed feed: %v", err)
	}
}

func TestSetSizeRefusedOnceRecording(t *testing.T) {
	var f Feed
	if err := f.SetSize(0); err == nil {
		t.Fatal("SetSize(0) accepted")
	}
	s, _, _, err := f.Subscribe(nil, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	if err := f.SetSize(4); err == nil {
		t.Fatal("SetSize after a subscription accepted")
	}
	if st := f.Stats(); st.Size != DefaultSize || st.Subscribers != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// BenchmarkPublish measures a publication of one record with one
// subscriber waiting.
func BenchmarkPublish(b *testing.B) {
	var f Feed
	s, _, _, err := f.Subscribe(nil, 0, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	r := Record{FP: 1, Key: "0123456789abcdef0123456789abcdef", Reason: Evicted, To: NoMount}
	for b.Loop() {
		f.Publish(r)
	}
}
