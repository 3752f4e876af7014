package protocol

import (
	"errors"
	"testing"
)

// purgeMessages are sample messages of purge's frame types.
func purgeMessages() []Message {
	return []Message{
		&Purge{Fingerprint: 0x360d51902c00e567},
		&Purged{Files: 3, Keys: 48, Bytes: 96 << 20, Pinned: 1},
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
		{"request with more", TypePurge, append((&Purge{}).AppendBody(nil), 0)},
		{"reply cut short", TypePurge | TypeReply, (&Purged{}).AppendBody(nil)[:31]},
	} {
		t.Run(c.name, func(t *testing.T) {
			if _, err := Decode(c.t, c.body); !errors.Is(err, ErrMalformed) {
				t.Fatalf("Decode = %v, want ErrMalformed", err)
			}
		})
	}
}
