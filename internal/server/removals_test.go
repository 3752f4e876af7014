package server_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/engine/removals"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/testwait"
	"github.com/kvhost/kvhost/protocol"
)

// TestEveryEngineReasonIsTheProtocolsOfTheSameName: the server sends an
// engine removal's reason as its number, so each number must name the
// same reason on both sides.
func TestEveryEngineReasonIsTheProtocolsOfTheSameName(t *testing.T) {
	for r := removals.Evicted; r <= removals.Moved; r++ {
		if got, want := protocol.RemovalReason(r).String(), r.String(); got != want {
			t.Errorf("reason %d: the protocol names it %q, the engine %q", r, got, want)
		}
	}
}

// storeMany stores n keys named prefix-i (long names: 60 bytes) from k's
// blocks, 16 keys a job, and returns them.
func storeMany(tb testing.TB, k *cache, prefix string, n int) [][]byte {
	tb.Helper()
	keys := make([][]byte, n)
	for i := range keys {
		keys[i] = fmt.Appendf(nil, "%s-%055d", prefix, i)[:60]
	}
	for at := 0; at < n; at += 16 {
		batch := keys[at:min(at+16, n)]
		blocks := make([][]uint32, len(batch))
		for i := range blocks {
			blocks[i] = []uint32{uint32(2 * i), uint32(2*i + 1)}
		}
		job, err := k.c.Store(context.Background(), k.id, batch, blocks)
		if err != nil {
			tb.Fatal(err)
		}
		if res, err := job.Wait(context.Background()); err != nil || res.Count(client.OutcomeStored) != len(batch) {
			tb.Fatalf("store: %v %v", err, res.Keys)
		}
	}
	return keys
}

// subscribeRaw sends a SubscribeRemovals of every namespace on r after
// its Hello, and returns the subscription's reply.
func subscribeRaw(t *testing.T, r *rawConn) *protocol.RemovalsSubscribed {
	t.Helper()
	r.send(1, &protocol.Hello{Version: 2, Client: "raw"})
	if _, m, err := r.recv(); err != nil || m.(*protocol.Welcome).Features&protocol.FeatureRemovals == 0 {
		t.Fatalf("welcome %+v, %v: want the removals feature", m, err)
	}
	r.send(2, &protocol.SubscribeRemovals{NS: []uint32{}})
	_, m, err := r.recv()
	if err != nil {
		t.Fatal(err)
	}
	sm, ok := m.(*protocol.RemovalsSubscribed)
	if !ok || len(sm.Mounts) != 1 {
		t.Fatalf("answered %#v: want a subscription naming the daemon's one mount", m)
	}
	return sm
}

// TestASlowRemovalSubscriberBlocksNothingAndSeesNoGap: a subscriber that
// reads nothing while 512 keys are deleted (with a ring of 64 records)
// holds up neither the deletes nor another subscriber, which reads every
// record as it comes; once the slow one reads, its events follow each
// other without a gap, or a resync stands for the records it lost.
func TestASlowRemovalSubscriberBlocksNothingAndSeesNoGap(t *testing.T) {
	f := newFixture(t, server.Config{})
	if err := f.eng.Removals().SetSize(64); err != nil {
		t.Fatal(err)
	}
	worker := f.dial(t)
	k := newCache(t, worker)
	keys := storeMany(t, k, "slow", 512)
	slow := f.raw(t)
	subscribeRaw(t, slow)
	fast := f.dial(t)
	sub, err := fast.Removals(context.Background(), client.RemovalCursor{})
	if err != nil {
		t.Fatal(err)
	}
	// The reader reads each delete's records before the next delete; the
	// slow subscriber reads nothing.
	seen := map[string]bool{}
	for at := 0; at < len(keys); at += 16 {
		if n, err := worker.Delete(context.Background(), k.ns.ID, keys[at:at+16]); n != 16 || err != nil {
			t.Fatalf("delete: %d, %v", n, err)
		}
		for len(seen) < at+16 {
			b := nextRemovals(t, sub)
			if b.Resync {
				t.Fatal("the reading subscriber was told to resync")
			}
			for _, r := range b.Records {
				seen[string(r.Key)] = true
			}
		}
	}
	var last uint64
	resyncs, records := 0, 0
	for last < f.eng.Removals().Stats().Head {
		_, m, err := slow.recv()
		if err != nil {
			t.Fatal(err)
		}
		ev := m.(*protocol.Removals)
		switch {
		case ev.Resync:
			resyncs++
		case len(ev.Records) > 0 && last != 0 && ev.Records[0].Seq != last+1:
			t.Fatalf("a gap: record %d after %d without a resync", ev.Records[0].Seq, last)
		}
		for i, r := range ev.Records {
			if i > 0 && r.Seq != ev.Records[i-1].Seq+1 {
				t.Fatalf("a gap inside an event: %d after %d", r.Seq, ev.Records[i-1].Seq)
			}
			records++
		}
		last = ev.Last
	}
	t.Logf("the slow subscriber read %d records and %d resyncs", records, resyncs)
	if resyncs == 0 && records != len(keys) {
		t.Fatalf("%d records and no resync, want %d records", records, len(keys))
	}
}

// nextRemovals is Next within testwait.Hang.
func nextRemovals(t *testing.T, s *client.RemovalSubscription) client.RemovalBatch {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Hang)
	defer cancel()
	b, err := s.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestRemovalSubscriptionsAreRefusedWhatTheyCannotBe: an undeclared
// namespace, a since past the daemon's last record in its epoch and an
// unknown subscription are refused, the connection kept.
func TestRemovalSubscriptionsAreRefusedWhatTheyCannotBe(t *testing.T) {
	f := newFixture(t, server.Config{})
	r := f.raw(t)
	first := subscribeRaw(t, r)
	r.send(3, &protocol.SubscribeRemovals{NS: []uint32{42}})
	r.expectCode(protocol.CodeUnknownNS)
	r.send(4, &protocol.SubscribeRemovals{Epoch: first.Epoch, Since: first.Last + 10})
	r.expectCode(protocol.CodeInvalid)
	r.send(5, &protocol.UnsubscribeRemovals{Subscription: first.Subscription + 7})
	r.expectCode(protocol.CodeInvalid)
	r.send(6, &protocol.UnsubscribeRemovals{Subscription: first.Subscription})
	if _, m, err := r.recv(); err != nil || m.Type() != protocol.TypeUnsubscribeRemovals|protocol.TypeReply {
		t.Fatalf("unsubscribe answered %#v, %v", m, err)
	}
	if st := f.eng.Removals().Stats(); st.Subscribers != 0 {
		t.Fatalf("%d subscribers after the unsubscription", st.Subscribers)
	}
}

// BenchmarkRemovalLag measures the time from a Delete's return on one
// connection to the delivery of its record to a subscription on another
// connection of one daemon, and reports its p50 and p99.
func BenchmarkRemovalLag(b *testing.B) {
	f := newFixture(b, server.Config{})
	worker := f.dial(b)
	k := newCache(b, worker)
	router := f.dial(b)
	sub, err := router.Removals(context.Background(), client.RemovalCursor{})
	if err != nil {
		b.Fatal(err)
	}
	var lags []time.Duration
	for i := 0; b.Loop(); i++ {
		b.StopTimer()
		keys := storeMany(b, k, fmt.Sprintf("lag%d", i), 1)
		b.StartTimer()
		t0 := time.Now()
		if n, err := worker.Delete(context.Background(), k.ns.ID, keys); n != 1 || err != nil {
			b.Fatalf("delete: %d %v", n, err)
		}
		for got := false; !got; {
			bt, err := sub.Next(context.Background())
			if err != nil {
				b.Fatal(err)
			}
			got = slices.ContainsFunc(bt.Records, func(r client.Removal) bool { return string(r.Key) == string(keys[0]) })
		}
		lags = append(lags, time.Since(t0))
	}
	slices.Sort(lags)
	if len(lags) > 0 {
		b.ReportMetric(micros(percentile(lags, 0.50)), "p50-µs")
		b.ReportMetric(micros(percentile(lags, 0.99)), "p99-µs")
	}
}
