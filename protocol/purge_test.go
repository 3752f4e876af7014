package protocol

import (
	"errors"
	"testing"
)

// purgeMessages are sample messages of purge's frame types.
func purgeMessages() []Message {
	return []Message{
		&Purge{Fingerprint: 0x360d51902c00e567},
		&Purge{Model: "vllm:meta-llama/Llama-3.1-8B-Instruct:0123456789abcdef"},
		&Purged{Namespaces: 2, Files: 3, Keys: 48, Bytes: 96 << 20, Pinned: 1, Left: 4},
		&Purged{},
	}
}

func TestPurgeMessagesRoundTrip(t *testing.T) {
	checkRoundTrips(t, purgeMessages())
}

func TestPurgeMessagesReject(t *testing.T) {
	for _, c := range []struct {
		name string
		t    Type
		body []byte
	}{
		{"request cut short", TypePurge, (&Purge{Fingerprint: 1}).AppendBody(nil)[:7]},
		{"model cut short", TypePurge, (&Purge{Model: "m"}).AppendBody(nil)[:9]},
		{"model too long", TypePurge, append(append(appendU64(nil, 0), MaxModelLen+1), make([]byte, MaxModelLen+1)...)},
		{"request with more", TypePurge, append((&Purge{}).AppendBody(nil), 0)},
		{"reply cut short", TypePurge | TypeReply, (&Purged{}).AppendBody(nil)[:39]},
		{"left cut short", TypePurge | TypeReply, (&Purged{}).AppendBody(nil)[:47]},
	} {
		t.Run(c.name, func(t *testing.T) {
			if _, err := Decode(c.t, c.body); !errors.Is(err, ErrMalformed) {
				t.Fatalf("Decode = %v, want ErrMalformed", err)
			}
		})
	}
}

// TestPurgedDecodesWhatAnOlderOrNewerDaemonSends: a Purged without its
// left count (a daemon that predates it) decodes with Left 0; one with
// more fields after it (a later daemon's) decodes, those ignored.
func TestPurgedDecodesWhatAnOlderOrNewerDaemonSends(t *testing.T) {
	full := (&Purged{Namespaces: 1, Files: 2, Keys: 3, Bytes: 4, Pinned: 5, Left: 6}).AppendBody(nil)
	for _, c := range []struct {
		name string
		body []byte
		want Purged
	}{
		{"without left", full[:40], Purged{Namespaces: 1, Files: 2, Keys: 3, Bytes: 4, Pinned: 5}},
		{"with more after left", append(full[:48:48], 7, 0, 0, 0), Purged{Namespaces: 1, Files: 2, Keys: 3, Bytes: 4, Pinned: 5, Left: 6}},
	} {
		t.Run(c.name, func(t *testing.T) {
			m, err := Decode(TypePurge|TypeReply, c.body)
			if err != nil {
				t.Fatal(err)
			}
			if got := *m.(*Purged); got != c.want {
				t.Fatalf("decoded %+v, want %+v", got, c.want)
			}
		})
	}
}
