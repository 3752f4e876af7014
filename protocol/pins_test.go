package protocol

import (
	"errors"
	"reflect"
	"testing"
)

// pinMessages are sample pin messages, of every pin frame type.
func pinMessages() []Message {
	return []Message{
		&Pin{NS: 3, LeaseMillis: 1500, Keys: [][]byte{[]byte("a"), []byte("bb")}},
		&Pin{NS: 1, Keys: [][]byte{[]byte("k")}},
		&Pinned{Pin: 9, State: []uint8{PinHeld, PinMissing}},
		&Pinned{State: []uint8{PinMissing}},
		&Pin{NS: 2, LeaseMillis: 10, Keys: [][]byte{[]byte("c")}, Loadable: true},
		&Pin{NS: 2, Keys: [][]byte{[]byte("c")}, Loadable: true, Group: "engine-7_dp0"},
		&Group{Name: "engine-7_dp0"},
		&Empty{T: TypeGroup | TypeReply},
		&Pinned{Pin: 4, State: []uint8{PinHeld, PinMissing}, Loadable: true},
		&Pinned{State: []uint8{PinNoCache, PinNoCache}, Loadable: true},
		&Unpin{Pin: 9},
		&Count{T: TypeUnpin | TypeReply, Count: 2},
	}
}

func TestPinMessagesRoundTrip(t *testing.T) {
	checkRoundTrips(t, pinMessages())
}

// checkRoundTrips checks that each message decodes from its encoding to
// an equal message.
func checkRoundTrips(t *testing.T, msgs []Message) {
	t.Helper()
	for _, m := range msgs {
		t.Run(m.Type().String(), func(t *testing.T) {
			got, err := Decode(m.Type(), m.AppendBody(nil))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, m) {
				t.Fatalf("decoded %#v, want %#v", got, m)
			}
		})
	}
}

func TestPinMessagesReject(t *testing.T) {
	body := func(m Message) []byte { return m.AppendBody(nil) }
	cases := []struct {
		name string
		t    Type
		body []byte
	}{
		{"lease past a day", TypePin, body(&Pin{NS: 1, LeaseMillis: MaxLeaseMillis + 1, Keys: [][]byte{[]byte("k")}})},
		{"no keys", TypePin, body(&Pin{NS: 1})},
		{"unknown state", TypePin | TypeReply, body(&Pinned{Pin: 1, State: []uint8{3}})},
		{"no cache answering a plain pin", TypePin | TypeReply, body(&Pinned{State: []uint8{PinNoCache}})},
		{"unknown state answering a loadable pin", TypePinLoadable | TypeReply, body(&Pinned{State: []uint8{3}, Loadable: true})},
		{"loadable lease past a day", TypePinLoadable, body(&Pin{NS: 1, LeaseMillis: MaxLeaseMillis + 1, Keys: [][]byte{[]byte("k")}, Loadable: true})},
		{"states short", TypePin | TypeReply, body(&Pinned{Pin: 1, State: []uint8{1, 1}})[:13]},
		{"unpin trailing", TypeUnpin, append(body(&Unpin{Pin: 1}), 0)},
		{"loadable pin without its group", TypePinLoadable, body(&Pin{NS: 1, Keys: [][]byte{[]byte("k")}})},
		{"empty group", TypeGroup, []byte{0}},
		{"group past its bound", TypeGroup, append([]byte{MaxGroupLen + 1}, make([]byte, MaxGroupLen+1)...)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if _, err := Decode(c.t, c.body); !errors.Is(err, ErrMalformed) {
				t.Fatalf("Decode = %v, want ErrMalformed", err)
			}
		})
	}
}
