package protocol

// Pins (protocol version 1, added after the first frame types): a client
// pins stored keys so that the daemon neither evicts nor deletes them
// until it unpins them, their lease runs out or its connection ends.
// docs/protocol.md ("Pins") is the specification.

// Frame types of pins.
const (
	TypePin   Type = 0x000E
	TypeUnpin Type = 0x000F
	// TypePinLoadable is a Pin whose keys are pinned only while a cache of
	// their namespace is registered on some connection: only while a
	// load of them has somewhere to go.
	TypePinLoadable Type = 0x0012
	// TypeGroup names the group of the connection's caches (one engine's
	// workers), which a PinLoadable can ask for.
	TypeGroup Type = 0x0013
)

// Limits of pins.
const (
	// MaxLeaseMillis is the longest lease a Pin may ask for (24 hours).
	MaxLeaseMillis = 24 * 60 * 60 * 1000
	// MaxGroupLen bounds a group's name (Group, PinLoadable).
	MaxGroupLen = 64
)

// Per-key states in a Pinned reply.
const (
	// PinMissing: the key is not stored (or its file vanished or was
	// replaced); nothing is pinned for it.
	PinMissing uint8 = 0
	// PinHeld: the key is stored, its file was checked (same inode, same
	// size) and it is pinned.
	PinHeld uint8 = 1
	// PinNoCache (PinLoadable replies only): the daemon has no cache of
	// the namespace registered on any connection, so nothing was looked
	// up or pinned.
	PinNoCache uint8 = 2
)

// Pin pins keys of a namespace for LeaseMillis milliseconds (0: until
// Unpin or the end of the connection). With Loadable it is a PinLoadable
// frame: its keys are pinned only while a cache of the namespace is
// registered, on a connection of Group where Group is not empty.
type Pin struct {
	NS          uint32   // the namespace id, from Declared
	LeaseMillis uint32   // the lease in milliseconds (0: none), at most MaxLeaseMillis
	Keys        [][]byte // the keys to pin
	Loadable    bool     // a PinLoadable frame
	Group       string   // PinLoadable only: the caches' group; "" for any connection's
}

// Type is TypePin, or TypePinLoadable for a Loadable pin.
func (m *Pin) Type() Type {
	if m.Loadable {
		return TypePinLoadable
	}
	return TypePin
}

// AppendBody encodes: u32 ns | u32 lease ms | keys, then for a
// PinLoadable str8 group.
func (m *Pin) AppendBody(b []byte) []byte {
	b = appendKeys(appendU32(appendU32(b, m.NS), m.LeaseMillis), m.Keys)
	if m.Loadable {
		b = appendStr8(b, m.Group, MaxGroupLen)
	}
	return b
}

// DecodeBody decodes a Pin.
func (m *Pin) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.NS = d.u32("ns")
	m.LeaseMillis = d.u32("lease ms")
	if d.err == nil && m.LeaseMillis > MaxLeaseMillis {
		d.fail("lease ms = %d: want 0..%d", m.LeaseMillis, MaxLeaseMillis)
	}
	m.Keys = d.keys()
	if m.Loadable {
		m.Group = d.str8("group", MaxGroupLen)
	}
	return d.end()
}

// Group names the group of the connection's caches: a PinLoadable that
// names the group counts only caches of connections in it. A connection
// joins one group, before it registers a cache.
type Group struct {
	Name string // 1..MaxGroupLen bytes, compared as bytes
}

// Type is TypeGroup.
func (*Group) Type() Type { return TypeGroup }

// AppendBody encodes: str8 name.
func (m *Group) AppendBody(b []byte) []byte { return appendStr8(b, m.Name, MaxGroupLen) }

// DecodeBody decodes a Group.
func (m *Group) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Name = d.str8("group", MaxGroupLen)
	if d.err == nil && m.Name == "" {
		d.fail("an empty group name")
	}
	return d.end()
}

// Pinned is the reply to Pin: the pin's id (0 when no key was pinned) and,
// per requested key in order, PinHeld or PinMissing (or, answering a
// PinLoadable, PinNoCache for every key).
type Pinned struct {
	Pin      uint64  // this connection's id of the pin; 0 when no key was pinned
	State    []uint8 // per requested key, in order: PinHeld, PinMissing or PinNoCache
	Loadable bool    // the reply to a PinLoadable
}

// Type is the reply to TypePin, or to TypePinLoadable.
func (m *Pinned) Type() Type {
	if m.Loadable {
		return TypePinLoadable | TypeReply
	}
	return TypePin | TypeReply
}

// AppendBody encodes: u64 pin id | u32 count | count × u8 state.
func (m *Pinned) AppendBody(b []byte) []byte {
	b = appendU32(appendU64(b, m.Pin), uint32(len(m.State)))
	return append(b, m.State...)
}

// DecodeBody decodes a Pinned.
func (m *Pinned) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Pin = d.u64("pin id")
	n := d.count("key count", 1, MaxKeysPerRequest, 1)
	m.State = append([]uint8(nil), d.take(n, "states")...)
	for i, s := range m.State {
		if s != PinMissing && s != PinHeld && (s != PinNoCache || !m.Loadable) {
			want := "0 or 1"
			if m.Loadable {
				want = "0, 1 or 2"
			}
			d.fail("state %d = %d: want %s", i, s, want)
			break
		}
	}
	return d.end()
}

// Unpin releases a pin.
type Unpin struct {
	Pin uint64 // the pin's id, from its Pinned
}

// Type is TypeUnpin.
func (*Unpin) Type() Type { return TypeUnpin }

// AppendBody encodes: u64 pin id.
func (m *Unpin) AppendBody(b []byte) []byte { return appendU64(b, m.Pin) }

// DecodeBody decodes an Unpin.
func (m *Unpin) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Pin = d.u64("pin id")
	return d.end()
}

// newPinMessage returns an empty pin message of type t, or nil.
func newPinMessage(t Type) Message {
	switch t {
	case TypePin:
		return new(Pin)
	case TypePin | TypeReply:
		return new(Pinned)
	case TypePinLoadable:
		return &Pin{Loadable: true}
	case TypePinLoadable | TypeReply:
		return &Pinned{Loadable: true}
	case TypeGroup:
		return new(Group)
	case TypeGroup | TypeReply:
		return &Empty{T: t}
	case TypeUnpin:
		return new(Unpin)
	case TypeUnpin | TypeReply:
		return &Count{T: t}
	}
	return nil
}
