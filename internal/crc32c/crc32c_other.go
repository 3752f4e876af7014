//go:build !amd64

package crc32c

// hasCLMUL: no carry-less multiply folding on this architecture.
const hasCLMUL = false

func foldCLMUL(out *[64]byte, p []byte, init uint32, k *[4]uint64) {
	panic("crc32c: foldCLMUL without PCLMULQDQ")
}
