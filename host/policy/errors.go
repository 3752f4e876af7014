package policy

import (
	"errors"
	"strconv"
)

// Sentinel errors. Errors returned by this package wrap one of them.
var (
	// ErrConfig: a Config field is invalid.
	ErrConfig = errors.New("policy: invalid config")
	// ErrModule: a plugin module does not implement ABI v1 (bad ABI version,
	// missing or mistyped export, unknown import or feature bit, bad memory,
	// no valid scratch area from kvhost_scratch): every problem Inspect
	// lists, found by Open before any instance is initialised.
	ErrModule = errors.New("policy: invalid plugin module")
	// ErrPlugin: a plugin hook failed (trap, timeout, memory limit, failure
	// status or invalid output). Errors wrapping it are *Error values.
	ErrPlugin = errors.New("policy: plugin failure")
	// ErrInput: the caller passed a record the host will not forward.
	ErrInput = errors.New("policy: invalid input")
	// ErrClosed: the Host was closed.
	ErrClosed = errors.New("policy: closed")
)

// Error is a failure of one hook call of a plugin (or of the native policy
// standing in for it). It wraps ErrPlugin and the reason.
type Error struct {
	Plugin string // the plugin's name
	Hook   string // the export, e.g. "kvhost_name"
	Shard  int    // the instance that failed
	Err    error  // the reason
}

// Error names the plugin, the hook and the shard before the cause.
func (e *Error) Error() string {
	return "policy " + e.Plugin + ": " + e.Hook + " (shard " + strconv.Itoa(e.Shard) + "): " + e.Err.Error()
}

// Unwrap returns ErrPlugin and the reason.
func (e *Error) Unwrap() []error { return []error{ErrPlugin, e.Err} }
