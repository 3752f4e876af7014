package protocol

// Purge (protocol version 1, added after the shared lookup table): an
// operator's tool removes every file of one namespace, declared or not,
// from the daemon's mounts. docs/protocol.md ("Purge") is the
// specification.

// Frame types of purge.
const (
	TypePurge Type = 0x0011
)

// Purge asks the daemon to remove every file of one namespace, or of
// every namespace of one model id: by Model where it is set (every
// namespace declared with the id since the daemon started), else by
// Fingerprint (a Stats reply's NamespaceStats.Fingerprint: also files
// found on the mounts that no client declared since). A daemon older than
// it answers CodeUnknownType; one that knows no such namespace,
// CodeUnknownNS.
type Purge struct {
	Fingerprint uint64
	Model       string // at most MaxModelLen bytes; "" purges by Fingerprint
}

// Type is TypePurge.
func (*Purge) Type() Type { return TypePurge }

// AppendBody encodes: u64 fingerprint | str8 model.
func (m *Purge) AppendBody(b []byte) []byte {
	return appendStr8(appendU64(b, m.Fingerprint), m.Model, MaxModelLen)
}

// DecodeBody decodes a Purge.
func (m *Purge) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Fingerprint = d.u64("fingerprint")
	m.Model = d.str8("model", MaxModelLen)
	return d.end()
}

// Purged is the reply to Purge: what the daemon removed, the files it
// left because a client pin holds them, and those it could not remove.
type Purged struct {
	Namespaces         uint64 // namespaces purged
	Files, Keys, Bytes uint64 // removed: files, the keys the index found in them, their bytes
	Pinned             uint64 // files left for their client pins
	// Left is the files whose removal failed: no longer served, still on
	// disk until a later purge or an eviction removes them. A reply
	// without it (its field absent) decodes as 0.
	Left uint64
}

// Type is the reply to TypePurge.
func (*Purged) Type() Type { return TypePurge | TypeReply }

// AppendBody encodes: u64 namespaces | u64 files | u64 keys | u64 bytes |
// u64 pinned | u64 left.
func (m *Purged) AppendBody(b []byte) []byte {
	b = appendU64(appendU64(appendU64(appendU64(appendU64(b, m.Namespaces), m.Files), m.Keys), m.Bytes), m.Pinned)
	return appendU64(b, m.Left)
}

// DecodeBody decodes a Purged: its left count where present (bytes after
// it are ignored, for fields a later daemon adds).
func (m *Purged) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Namespaces = d.u64("namespaces")
	m.Files, m.Keys, m.Bytes, m.Pinned = d.u64("files"), d.u64("keys"), d.u64("bytes"), d.u64("pinned")
	m.Left = 0
	if d.err == nil && len(d.b) > 0 {
		m.Left = d.u64("left")
		d.b = nil
	}
	return d.end()
}

// newPurgeMessage returns a new message of purge's type t, or nil.
func newPurgeMessage(t Type) Message {
	switch t {
	case TypePurge:
		return new(Purge)
	case TypePurge | TypeReply:
		return new(Purged)
	}
	return nil
}
