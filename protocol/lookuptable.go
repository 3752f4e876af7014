package protocol

// The shared lookup table (protocol version 1, added after pins): a client
// asks once where the daemon's table is and then answers lookups from its
// own read-only mapping of it. docs/protocol.md ("Shared lookup table")
// is the specification.

// Frame types of the shared lookup table.
const (
	TypeLookupTable Type = 0x0010
)

// MaxTablePath bounds the table's path in a TableLocation.
const MaxTablePath = 4096

// LookupTableRequest asks where the daemon's shared lookup table is. A
// daemon without one answers CodeUnsupported; one older than the table
// answers CodeUnknownType: either way the client keeps asking the daemon.
type LookupTableRequest struct{}

// Type is TypeLookupTable.
func (*LookupTableRequest) Type() Type { return TypeLookupTable }

// AppendBody encodes an empty body.
func (*LookupTableRequest) AppendBody(b []byte) []byte { return b }

// DecodeBody decodes an empty body.
func (*LookupTableRequest) DecodeBody(b []byte) error {
	d := decoder{b: b}
	return d.end()
}

// TableLocation is the reply to LookupTableRequest: the table file's
// path, for the client to map read-only.
type TableLocation struct {
	Path string // the table file's path; never empty
}

// Type is the reply to TypeLookupTable.
func (*TableLocation) Type() Type { return TypeLookupTable | TypeReply }

// AppendBody encodes: str16 path.
func (m *TableLocation) AppendBody(b []byte) []byte { return appendStr16(b, m.Path, MaxTablePath) }

// DecodeBody decodes a TableLocation.
func (m *TableLocation) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Path = d.str16("table path", MaxTablePath)
	if d.err == nil && m.Path == "" {
		d.fail("empty table path")
	}
	return d.end()
}

// newTableMessage returns a new message of the shared lookup table's
// type t, or nil.
func newTableMessage(t Type) Message {
	switch t {
	case TypeLookupTable:
		return new(LookupTableRequest)
	case TypeLookupTable | TypeReply:
		return new(TableLocation)
	}
	return nil
}
