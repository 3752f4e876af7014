package protocol

import (
	"errors"
	"testing"
)

// removalMessages are samples of every removal-stream message.
func removalMessages() []Message {
	return []Message{
		&SubscribeRemovals{Epoch: 0, Since: 0, NS: []uint32{}},
		&SubscribeRemovals{Epoch: 0xfeed, Since: 41, NS: []uint32{1, 7}},
		&RemovalsSubscribed{Subscription: 3, Epoch: 0xfeed, Last: 99, Mounts: []string{"memory", "nvme"}},
		&RemovalsSubscribed{Subscription: 4, Mounts: []string{}},
		&UnsubscribeRemovals{Subscription: 3},
		&Empty{T: TypeUnsubscribeRemovals | TypeReply},
		&Removals{Subscription: 3, Resync: true, Last: 120, Records: []Removal{}},
		&Removals{Subscription: 3, Last: 122, Records: []Removal{
			{Seq: 121, Fingerprint: 0xabc, Reason: RemovalEvicted, Mount: 0, To: NoRemovalMount, Time: 1_700_000_000_000_000_000, Key: []byte("k1")},
			{Seq: 122, Fingerprint: 0xabc, Reason: RemovalMoved, Mount: 0, To: 1, Time: 1_700_000_000_000_000_001, Key: make([]byte, MaxKeyLen)},
		}},
		&Welcome{Version: 2, MaxFrame: 1 << 20, Server: "kvhost", Features: FeatureLayerLoads | FeatureRemovals},
	}
}

func TestRemovalMessagesRoundTrip(t *testing.T) {
	checkRoundTrips(t, removalMessages())
}

// TestRemovalMessagesRejectBadBodies: a resync carrying records, unknown
// flags, a key of 0 bytes, a count past the batch bound and trailing bytes
// are malformed.
func TestRemovalMessagesRejectBadBodies(t *testing.T) {
	rec := Removal{Seq: 1, Fingerprint: 2, Reason: RemovalDeleted, To: NoRemovalMount, Key: []byte("k")}
	body := func(m Message) []byte { return m.AppendBody(nil) }
	flags := body(&Removals{Subscription: 1})
	flags[4] = 2
	count := body(&Removals{Subscription: 1})
	count[16], count[17] = byte((MaxRemovalBatch+1)&0xff), byte((MaxRemovalBatch+1)>>8)
	for _, tc := range []struct {
		name string
		t    Type
		body []byte
	}{
		{"resync with records", TypeRemovals, body(&Removals{Resync: true, Records: []Removal{rec}})},
		{"unknown flags", TypeRemovals, flags},
		{"count past the batch bound", TypeRemovals, count},
		{"empty key", TypeRemovals, body(&Removals{Records: []Removal{{Key: nil}}})},
		{"removals trailing", TypeRemovals, append(body(&Removals{Records: []Removal{rec}}), 0)},
		{"subscribe trailing", TypeSubscribeRemovals, append(body(&SubscribeRemovals{NS: []uint32{1}}), 0)},
		{"subscribe short", TypeSubscribeRemovals, body(&SubscribeRemovals{NS: []uint32{1}})[:20]},
		{"unsubscribe trailing", TypeUnsubscribeRemovals, append(body(&UnsubscribeRemovals{Subscription: 1}), 0)},
		{"subscribed without its mounts", TypeSubscribeRemovals | TypeReply, body(&RemovalsSubscribed{Mounts: []string{"nvme"}})[:20]},
		{"subscribed mount class cut short", TypeSubscribeRemovals | TypeReply, body(&RemovalsSubscribed{Mounts: []string{"nvme"}})[:24]},
	} {
		if _, err := Decode(tc.t, tc.body); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %v, want ErrMalformed", tc.name, err)
		}
	}
}

// TestRemovalTypesNameThemselves: the new types name themselves, and a
// Removal's encoded size is what RemovalSize says.
func TestRemovalTypesNameThemselves(t *testing.T) {
	for typ, want := range map[Type]string{
		TypeSubscribeRemovals: "subscribe-removals", TypeSubscribeRemovals | TypeReply: "subscribe-removals-reply",
		TypeUnsubscribeRemovals: "unsubscribe-removals", TypeRemovals: "removals",
	} {
		if got := typ.String(); got != want {
			t.Errorf("%04x: %q, want %q", uint16(typ), got, want)
		}
	}
	one := (&Removals{Records: []Removal{{Key: []byte("abc")}}}).AppendBody(nil)
	none := (&Removals{}).AppendBody(nil)
	if len(one)-len(none) != RemovalSize(3) {
		t.Fatalf("a removal of a 3-byte key takes %d bytes, RemovalSize says %d", len(one)-len(none), RemovalSize(3))
	}
	if RemovalReason(9).String() != "reason(9)" || RemovalVanished.String() != "vanished" {
		t.Fatal("reason names")
	}
}
