package protocol

import "github.com/kvhost/kvhost/outcome"

// Removal streams (protocol version 2, FeatureRemovals): a client
// subscribes to the removals of its namespaces (SubscribeRemovals) and the
// daemon pushes them in Removals events, in sequence order, each batch
// with the sequence number to subscribe again from after a reconnection.
// A subscription the daemon cannot serve without a gap gets a resync
// instead: every key of its namespaces may have been removed.
// docs/protocol.md ("Removal streams") is the specification.

// Frame types of removal streams.
const (
	TypeSubscribeRemovals   Type = 0x0015
	TypeUnsubscribeRemovals Type = 0x0016
	// TypeRemovals is the event that carries a batch of removals (request
	// id 0).
	TypeRemovals Type = 0x4002
)

// FeatureRemovals: the daemon serves SubscribeRemovals and
// UnsubscribeRemovals, and pushes Removals events.
const FeatureRemovals Feature = 1 << 1

// MaxRemovalBatch bounds the records of one Removals event.
const MaxRemovalBatch = 4096

// RemovalReason is why a key left the daemon (a Removal's reason): the
// vocabulary's (outcome.Reason), which the engine's removal records
// speak too. The values are on the wire.
type RemovalReason = outcome.Reason

// Reasons of a removal (outcome.Evicted, ...: documented there).
const (
	RemovalEvicted        = outcome.Evicted        // evicted for room on its mount (or a demotion's victim deleted)
	RemovalClusterEvicted = outcome.ClusterEvicted // evicted to keep a cluster mount within its shared capacity
	RemovalDeleted        = outcome.Deleted        // a client deleted it
	RemovalPurged         = outcome.Purged         // its namespace was purged
	RemovalCorrupt        = outcome.Corrupt        // its file failed its checks
	RemovalVanished       = outcome.Vanished       // removed behind the daemon's back (another node on a shared mount)
	RemovalMoved          = outcome.Moved          // still stored, on another mount (Removal.To): a medium change
)

// NoRemovalMount is Removal.To of a removal that is not a move.
const NoRemovalMount = 0xFFFF

// SubscribeRemovals asks for the removals of namespaces NS (ids declared
// on this connection; none: every namespace of the daemon) after Since in
// Epoch: 0 and 0 the first time, then the Epoch of the daemon's answer
// and the Last of the last Removals event read.
type SubscribeRemovals struct {
	Epoch uint64
	Since uint64
	NS    []uint32
}

// Type is TypeSubscribeRemovals.
func (*SubscribeRemovals) Type() Type { return TypeSubscribeRemovals }

// AppendBody encodes: u64 epoch | u64 since | u32 count | count × u32
// namespace id.
func (m *SubscribeRemovals) AppendBody(b []byte) []byte {
	b = appendU32(appendU64(appendU64(b, m.Epoch), m.Since), uint32(len(m.NS)))
	for _, ns := range m.NS {
		b = appendU32(b, ns)
	}
	return b
}

// DecodeBody decodes a SubscribeRemovals.
func (m *SubscribeRemovals) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Epoch, m.Since = d.u64("epoch"), d.u64("since")
	n := d.count("namespace count", 0, MaxKeysPerRequest, 4)
	m.NS = make([]uint32, n)
	for i := range m.NS {
		m.NS[i] = d.u32("namespace id")
	}
	return d.end()
}

// RemovalsSubscribed is the reply to SubscribeRemovals: the
// subscription's id (which its Removals events carry), the daemon's epoch
// and its last sequence number now. Where the subscription's since
// cannot be served without a gap, its first event is a resync.
type RemovalsSubscribed struct {
	Subscription uint32
	Epoch        uint64
	Last         uint64
	// Mounts are the device classes of the daemon's mounts by the index
	// a Removal's Mount and To name ("memory", "nvme", "ssd", "hdd",
	// "network", "unknown"; each at most MaxName bytes): a client's map
	// from a mount to its medium.
	Mounts []string
}

// Type is the reply to TypeSubscribeRemovals.
func (*RemovalsSubscribed) Type() Type { return TypeSubscribeRemovals | TypeReply }

// MaxRemovalMounts bounds the mounts of a RemovalsSubscribed.
const MaxRemovalMounts = 256

// AppendBody encodes: u32 subscription | u64 epoch | u64 last | u16
// mounts | per mount: str8 device class.
func (m *RemovalsSubscribed) AppendBody(b []byte) []byte {
	b = appendU64(appendU64(appendU32(b, m.Subscription), m.Epoch), m.Last)
	b = appendU16(b, uint16(len(m.Mounts)))
	for _, c := range m.Mounts {
		b = appendStr8(b, c, MaxName)
	}
	return b
}

// DecodeBody decodes a RemovalsSubscribed; bytes after its fields (a
// later daemon's) are ignored.
func (m *RemovalsSubscribed) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Subscription, m.Epoch, m.Last = d.u32("subscription"), d.u64("epoch"), d.u64("last")
	n := int(d.u16("mount count"))
	if d.err == nil && n > MaxRemovalMounts {
		d.fail("mount count %d: at most %d", n, MaxRemovalMounts)
	}
	if d.err != nil {
		return d.err
	}
	m.Mounts = make([]string, n)
	for i := range m.Mounts {
		m.Mounts[i] = d.str8("mount class", MaxName)
	}
	return d.err
}

// UnsubscribeRemovals ends a subscription of this connection; the reply
// is empty. Events of it already sent may still arrive before the reply.
type UnsubscribeRemovals struct {
	Subscription uint32
}

// Type is TypeUnsubscribeRemovals.
func (*UnsubscribeRemovals) Type() Type { return TypeUnsubscribeRemovals }

// AppendBody encodes: u32 subscription.
func (m *UnsubscribeRemovals) AppendBody(b []byte) []byte { return appendU32(b, m.Subscription) }

// DecodeBody decodes an UnsubscribeRemovals.
func (m *UnsubscribeRemovals) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Subscription = d.u32("subscription")
	return d.end()
}

// Removal is one key that left the daemon, or changed mount.
type Removal struct {
	Seq         uint64        // its sequence number in the daemon's epoch
	Fingerprint uint64        // its namespace's (the Declared reply's)
	Reason      RemovalReason // why
	Mount       uint16        // the mount it left (the Stats reply's mount index)
	To          uint16        // RemovalMoved: the mount it is on now; else NoRemovalMount
	Time        uint64        // when the daemon recorded it, Unix nanoseconds
	Key         []byte        // 1..MaxKeyLen bytes
}

// removalFixed is the encoded size of a Removal without its key bytes.
const removalFixed = 8 + 8 + 1 + 1 + 2 + 2 + 8 + 1

// RemovalSize is the encoded size of a Removal of a key of n bytes.
func RemovalSize(n int) int { return removalFixed + n }

// Removals is an event of a subscription (request id 0): its removals
// after the last event's, in sequence order, or a resync.
type Removals struct {
	Subscription uint32
	// Resync: removals were lost to the subscription (it fell behind
	// the daemon's ring, or subscribed with a since the ring no longer
	// holds or of another epoch): every key of its namespaces may have
	// been removed. Records is empty.
	Resync  bool
	Last    uint64 // the since to subscribe again with, in the subscription's epoch
	Records []Removal
}

// Type is TypeRemovals.
func (*Removals) Type() Type { return TypeRemovals }

// AppendBody encodes: u32 subscription | u8 flags (1: resync) | 3 pad |
// u64 last | u32 count | per record: u64 seq | u64 fingerprint | u8
// reason | u8 pad | u16 mount | u16 to | u64 time | u8 key length | key.
func (m *Removals) AppendBody(b []byte) []byte {
	b = appendU32(b, m.Subscription)
	var flags byte
	if m.Resync {
		flags = 1
	}
	b = append(b, flags, 0, 0, 0)
	b = appendU32(appendU64(b, m.Last), uint32(len(m.Records)))
	for _, r := range m.Records {
		b = appendU64(appendU64(b, r.Seq), r.Fingerprint)
		b = append(b, byte(r.Reason), 0)
		b = appendU64(appendU16(appendU16(b, r.Mount), r.To), r.Time)
		b = append(append(b, uint8(len(r.Key))), r.Key...)
	}
	return b
}

// DecodeBody decodes a Removals event.
func (m *Removals) DecodeBody(b []byte) error {
	d := decoder{b: b}
	m.Subscription = d.u32("subscription")
	flags := d.u8("flags")
	d.zero(3)
	if d.err == nil && flags&^1 != 0 {
		d.fail("removal flags 0x%02x: want 0 or 1", flags)
	}
	m.Resync = flags&1 != 0
	m.Last = d.u64("last")
	n := d.count("removal count", 0, MaxRemovalBatch, removalFixed+1)
	m.Records = make([]Removal, n)
	for i := range m.Records {
		r := &m.Records[i]
		r.Seq, r.Fingerprint = d.u64("seq"), d.u64("fingerprint")
		r.Reason = RemovalReason(d.u8("reason"))
		d.zero(1)
		r.Mount, r.To, r.Time = d.u16("mount"), d.u16("to mount"), d.u64("time")
		l := int(d.u8("key length"))
		if d.err == nil && (l == 0 || l > MaxKeyLen) {
			d.fail("removal %d: key length %d: want 1..%d", i, l, MaxKeyLen)
		}
		r.Key = d.take(l, "key")
		if d.err != nil {
			return d.err
		}
	}
	if d.err == nil && m.Resync && n > 0 {
		d.fail("a resync with %d removals", n)
	}
	return d.end()
}

// newRemovalMessage returns a new message of removal streams' type t, or
// nil.
func newRemovalMessage(t Type) Message {
	switch t {
	case TypeSubscribeRemovals:
		return new(SubscribeRemovals)
	case TypeSubscribeRemovals | TypeReply:
		return new(RemovalsSubscribed)
	case TypeUnsubscribeRemovals:
		return new(UnsubscribeRemovals)
	case TypeUnsubscribeRemovals | TypeReply:
		return &Empty{T: t}
	case TypeRemovals:
		return new(Removals)
	}
	return nil
}
