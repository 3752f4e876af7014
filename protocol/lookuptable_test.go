package protocol

import (
	"errors"
	"strings"
	"testing"
)

// tableMessages are sample messages of the lookup table's frame types.
func tableMessages() []Message {
	return []Message{
		&LookupTableRequest{},
		&TableLocation{Path: "/run/kvhost/kvhost.sock.lookup"},
	}
}

func TestLookupTableMessagesRoundTrip(t *testing.T) {
	checkRoundTrips(t, tableMessages())
}

func TestLookupTableMessagesReject(t *testing.T) {
	long := appendU16(nil, MaxTablePath+1)
	long = append(long, strings.Repeat("a", MaxTablePath+1)...)
	cases := []struct {
		name string
		t    Type
		body []byte
	}{
		{"request with a body", TypeLookupTable, []byte{0}},
		{"empty path", TypeLookupTable | TypeReply, (&TableLocation{}).AppendBody(nil)},
		{"path too long", TypeLookupTable | TypeReply, long},
		{"path short", TypeLookupTable | TypeReply, (&TableLocation{Path: "/run/x"}).AppendBody(nil)[:4]},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if _, err := Decode(c.t, c.body); !errors.Is(err, ErrMalformed) {
				t.Fatalf("Decode = %v, want ErrMalformed", err)
			}
		})
	}
}
