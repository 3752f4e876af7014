//go:build !wasip1

package guest

// Register is a no-op outside wasm: a native build drives a Policy through
// its own Dispatcher. It exists so that a plugin's main package also compiles
// natively.
func Register(Policy) {}

// Log discards the message outside wasm.
func Log(level int32, msg string) {}
