// Package protocol is the kvhost wire format: length-prefixed, little-endian
// binary frames exchanged over the daemon's Unix socket. It encodes and
// decodes every message and validates every length, count and index; it
// does no I/O and holds no policy. docs/protocol.md is the specification.
//
// A frame is a 16-byte header followed by its body:
//
//	u32 body length | u16 type | u16 flags (0) | u64 request id | body
//
// A request carries a client-chosen request id; its reply (type |
// TypeReply) or an Error frame carries the same id. Completion events of
// store and load jobs are pushed with request id 0 and name their job.
package protocol

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Version is the newest protocol version this package speaks; a daemon
// answers a Hello of any version from MinVersion to Version in the
// Hello's version (version 2: the Welcome carries features).
const Version = 2

// MinVersion is the oldest protocol version this package speaks.
const MinVersion = 1

// Magic opens the Hello body: "KVHOST", then bytes 0 and 1.
const Magic = "KVHOST\x00\x01"

// HeaderSize is the size of a frame header.
const HeaderSize = 16

// Limits fixed by the protocol (the daemon's configurable limits are sent in
// Welcome).
const (
	// MaxKeyLen is the longest key, in bytes (keys are 1..MaxKeyLen bytes).
	MaxKeyLen = 64
	// MaxModelLen is the longest model id.
	MaxModelLen = 128
	// MaxKeysPerRequest bounds the keys of one Lookup, Store, Load or Delete.
	MaxKeysPerRequest = 4096
	// MaxBlocksPerKey bounds the GPU blocks one key covers.
	MaxBlocksPerKey = 4096
	// MaxLayers bounds the layers of a cache registration.
	MaxLayers = 4096
	// MaxMessage bounds the message of an Error or Completion.
	MaxMessage = 4096
	// MaxName bounds the client and server names of the handshake.
	MaxName = 64
	// CUDAIPCHandleLen is the size of a cudaIpcMemHandle_t.
	CUDAIPCHandleLen = 64
	// MinFrame is the smallest max_frame a daemon may announce.
	MinFrame = 64 << 10
	// MaxFrame is the largest max_frame a daemon may announce.
	MaxFrame = 1 << 30
	// MaxHandshakeFrame bounds a frame, header included, before the
	// handshake completes: the client does not know the daemon's max_frame
	// until Welcome announces it, and no daemon announces less.
	MaxHandshakeFrame = MinFrame
)

// Type is a frame type.
type Type uint16

// Frame types. A reply has the type of its request with TypeReply set.
const (
	TypeHello            Type = 0x0001
	TypeRegisterMemory   Type = 0x0002
	TypeUnregisterMemory Type = 0x0003
	TypeDeclare          Type = 0x0004
	TypeRegisterCache    Type = 0x0005
	TypeUnregisterCache  Type = 0x0006
	TypeLookup           Type = 0x0007
	TypeStore            Type = 0x0008
	TypeLoad             Type = 0x0009
	TypeCancel           Type = 0x000A
	TypeDelete           Type = 0x000B
	TypeStats            Type = 0x000C
	TypeUndeclare        Type = 0x000D

	// TypeReply is set in the type of every successful reply.
	TypeReply Type = 0x8000
	// TypeError is the reply to a request that failed.
	TypeError Type = 0xFFFF
	// TypeCompletion is the event that ends a store or load job.
	TypeCompletion Type = 0x4001
)

// String names the type.
func (t Type) String() string {
	if n := t.name(); n != "" {
		return n
	}
	if t&TypeReply != 0 && t != TypeError {
		if n := (t &^ TypeReply).name(); n != "" {
			return n + "-reply"
		}
	}
	return fmt.Sprintf("type(0x%04x)", uint16(t))
}

// name is a known type's name, or "" (a switch: String runs on the
// request path, for metrics labels, and allocates nothing for known types).
func (t Type) name() string {
	switch t {
	case TypeHello:
		return "hello"
	case TypeRegisterMemory:
		return "register-memory"
	case TypeUnregisterMemory:
		return "unregister-memory"
	case TypeDeclare:
		return "declare"
	case TypeRegisterCache:
		return "register-cache"
	case TypeUnregisterCache:
		return "unregister-cache"
	case TypeLookup:
		return "lookup"
	case TypeStore:
		return "store"
	case TypeLoad:
		return "load"
	case TypeCancel:
		return "cancel"
	case TypeDelete:
		return "delete"
	case TypeStats:
		return "stats"
	case TypeUndeclare:
		return "undeclare"
	case TypeError:
		return "error"
	case TypeCompletion:
		return "completion"
	case TypePin:
		return "pin"
	case TypeUnpin:
		return "unpin"
	case TypePinLoadable:
		return "pin-loadable"
	case TypeGroup:
		return "group"
	case TypeLookupTable:
		return "lookup-table"
	case TypePurge:
		return "purge"
	case TypeLoadLayers:
		return "load-layers"
	case TypeSubscribeRemovals:
		return "subscribe-removals"
	case TypeUnsubscribeRemovals:
		return "unsubscribe-removals"
	case TypeRemovals:
		return "removals"
	}
	return ""
}

// Errors of the package.
var (
	// ErrMalformed: a frame or body does not decode (short, trailing bytes,
	// a length, count or value out of range).
	ErrMalformed = errors.New("protocol: malformed frame")
	// ErrTooLarge: a frame is larger than the negotiated limit.
	ErrTooLarge = errors.New("protocol: frame too large")
	// ErrUnknownType: the frame type is not one of this version's.
	ErrUnknownType = errors.New("protocol: unknown frame type")
)

// Header is a decoded frame header.
type Header struct {
	Len   uint32 // body length
	Type  Type   // frame type
	Flags uint16 // reserved: 0
	ID    uint64 // request id
}

// ParseHeader decodes a header and checks it against maxFrame (the most
// bytes a whole frame may have).
func ParseHeader(b []byte, maxFrame int) (Header, error) {
	if len(b) < HeaderSize {
		return Header{}, fmt.Errorf("%w: header of %d bytes", ErrMalformed, len(b))
	}
	h := Header{
		Len:   binary.LittleEndian.Uint32(b[0:]),
		Type:  Type(binary.LittleEndian.Uint16(b[4:])),
		Flags: binary.LittleEndian.Uint16(b[6:]),
		ID:    binary.LittleEndian.Uint64(b[8:]),
	}
	if int64(h.Len)+HeaderSize > int64(maxFrame) {
		return h, fmt.Errorf("%w: %d-byte body, limit %d bytes per frame", ErrTooLarge, h.Len, maxFrame)
	}
	if h.Flags != 0 {
		return h, fmt.Errorf("%w: flags 0x%04x: want 0", ErrMalformed, h.Flags)
	}
	return h, nil
}

// Message is a frame body.
type Message interface {
	// Type is the frame type the message travels in.
	Type() Type
	// AppendBody appends the encoded body to b.
	AppendBody(b []byte) []byte
	// DecodeBody replaces the message with the decoded body, which must be
	// consumed exactly.
	DecodeBody(b []byte) error
}

// AppendFrame appends a whole frame carrying m with request id id to dst.
func AppendFrame(dst []byte, id uint64, m Message) []byte {
	start := len(dst)
	dst = append(dst, make([]byte, HeaderSize)...)
	dst = m.AppendBody(dst)
	binary.LittleEndian.PutUint32(dst[start:], uint32(len(dst)-start-HeaderSize))
	binary.LittleEndian.PutUint16(dst[start+4:], uint16(m.Type()))
	binary.LittleEndian.PutUint16(dst[start+6:], 0)
	binary.LittleEndian.PutUint64(dst[start+8:], id)
	return dst
}

// New returns an empty message of type t, or ErrUnknownType.
func New(t Type) (Message, error) {
	switch t {
	case TypeHello:
		return new(Hello), nil
	case TypeHello | TypeReply:
		return new(Welcome), nil
	case TypeRegisterMemory:
		return new(RegisterMemory), nil
	case TypeRegisterMemory | TypeReply:
		return new(MemoryRegistered), nil
	case TypeUnregisterMemory:
		return new(UnregisterMemory), nil
	case TypeDeclare:
		return new(Declare), nil
	case TypeDeclare | TypeReply:
		return new(Declared), nil
	case TypeRegisterCache:
		return new(RegisterCache), nil
	case TypeRegisterCache | TypeReply:
		return new(CacheRegistered), nil
	case TypeUnregisterCache:
		return new(UnregisterCache), nil
	case TypeLookup:
		return new(Lookup), nil
	case TypeLookup | TypeReply, TypeDelete | TypeReply:
		return &Count{T: t}, nil
	case TypeStore:
		return &Transfer{Kind: JobStore}, nil
	case TypeLoad:
		return &Transfer{Kind: JobLoad}, nil
	case TypeStore | TypeReply, TypeLoad | TypeReply:
		return &JobAccepted{T: t}, nil
	case TypeCancel:
		return new(Cancel), nil
	case TypeCancel | TypeReply:
		return new(Cancelled), nil
	case TypeDelete:
		return new(Delete), nil
	case TypeStats:
		return new(StatsRequest), nil
	case TypeStats | TypeReply:
		return new(Stats), nil
	case TypeUndeclare:
		return new(Undeclare), nil
	case TypeUnregisterMemory | TypeReply, TypeUnregisterCache | TypeReply, TypeUndeclare | TypeReply:
		return &Empty{T: t}, nil
	case TypeError:
		return new(Error), nil
	case TypeCompletion:
		return new(Completion), nil
	}
	if m := newPinMessage(t); m != nil {
		return m, nil
	}
	if m := newTableMessage(t); m != nil {
		return m, nil
	}
	if m := newPurgeMessage(t); m != nil {
		return m, nil
	}
	if m := newLayerMessage(t); m != nil {
		return m, nil
	}
	if m := newRemovalMessage(t); m != nil {
		return m, nil
	}
	return nil, fmt.Errorf("%w: %s", ErrUnknownType, t)
}

// Decode decodes a body of type t.
func Decode(t Type, body []byte) (Message, error) {
	m, err := New(t)
	if err != nil {
		return nil, err
	}
	if err := m.DecodeBody(body); err != nil {
		return nil, err
	}
	return m, nil
}
