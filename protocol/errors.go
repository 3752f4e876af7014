package protocol

import "fmt"

// Code is an error code of an Error frame or a failed key.
type Code uint8

// Error codes.
const (
	CodeOK            Code = 0
	CodeMalformed     Code = 1  // the frame or body does not decode
	CodeVersion       Code = 2  // unsupported protocol version
	CodeUnknownType   Code = 3  // the frame type is not a request of this version (a second Hello included)
	CodeHandshake     Code = 4  // a request before Hello
	CodeLimit         Code = 5  // a per-connection limit would be exceeded
	CodeUnknownRegion Code = 6  // the region id was not registered on this connection
	CodeUnknownNS     Code = 7  // the namespace id was not declared on this connection
	CodeUnknownCache  Code = 8  // the cache id was not registered on this connection
	CodeInvalid       Code = 9  // a value is out of range (geometry, tensor, block id, ...)
	CodeUnsupported   Code = 10 // a valid request this daemon cannot serve (e.g. CUDA IPC)
	CodeNoFd          Code = 11 // a memfd registration arrived without its descriptor
	CodeBadFd         Code = 12 // the descriptor is not a usable memfd (type, size, seals)
	CodeInUse         Code = 13 // the region or cache is still used by a cache or a job
	CodeNoSpace       Code = 14 // no space on the mount, even after eviction
	CodeNotFound      Code = 15 // the key is not stored
	CodeCorrupt       Code = 16 // a file failed verification
	CodePolicy        Code = 17 // the placement policy failed
	CodeShuttingDown  Code = 18 // the daemon is shutting down
	CodeCancelled     Code = 19 // the job was cancelled
	CodeInternal      Code = 20 // anything else; the message says what
	CodeTimeout       Code = 21 // the connection missed a deadline (handshake, frame, idle, write)
	CodeBadHandle     Code = 22 // a CUDA IPC handle names no live memory on that device (stale, forged, another device's)
	// CodeDestinationChanged: per key of a load, the client's own
	// destination blocks changed while the daemon wrote them (another
	// writer of the client's memory, or a load into blocks still in
	// use): the key's checksum, computed from them, failed, while the
	// file, read again into the daemon's own memory, verifies and stays.
	// The blocks hold no good copy of the key; loading it again into
	// blocks nothing else writes succeeds. A client older than this code
	// decodes it as a failure with an unnamed code (code(23)).
	CodeDestinationChanged Code = 23
)

// String names the code.
func (c Code) String() string {
	names := [...]string{"ok", "malformed", "unsupported version", "unknown type", "handshake required",
		"limit exceeded", "unknown region", "unknown namespace", "unknown cache", "invalid argument",
		"unsupported", "descriptor missing", "bad descriptor", "in use", "no space", "not found",
		"corrupt", "policy failure", "shutting down", "cancelled", "internal error", "timed out",
		"bad IPC handle", "destination changed"}
	if int(c) < len(names) {
		return names[c]
	}
	return fmt.Sprintf("code(%d)", uint8(c))
}

// Error is the reply to a failed request; it is also a Go error.
type Error struct {
	Code    Code   // why the request failed; never CodeOK
	Message string // at most MaxMessage bytes
}

// Error formats the code and message.
func (e *Error) Error() string {
	if e.Message == "" {
		return "kvhost: " + e.Code.String()
	}
	return "kvhost: " + e.Code.String() + ": " + e.Message
}

// Is matches another *Error with the same code, so that
// errors.Is(err, &protocol.Error{Code: protocol.CodeLimit}) works.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Code == e.Code && t.Message == ""
}

// Type is TypeError.
func (*Error) Type() Type { return TypeError }

// AppendBody encodes: u8 code | u8 0 | str16 message.
func (e *Error) AppendBody(b []byte) []byte {
	return appendStr16(append(b, uint8(e.Code), 0), e.Message, MaxMessage)
}

// DecodeBody decodes an Error.
func (e *Error) DecodeBody(b []byte) error {
	d := decoder{b: b}
	e.Code = Code(d.u8("code"))
	d.zero(1)
	e.Message = d.str16("message", MaxMessage)
	if d.err == nil && e.Code == CodeOK {
		// Codes above the last this package names are a newer daemon's
		// (docs/protocol.md, Versioning): an error still.
		d.fail("error code %d", e.Code)
	}
	return d.end()
}
