package crc32c

import "golang.org/x/sys/cpu"

// hasCLMUL: the CPU and the OS can fold with AVX-512 VPCLMULQDQ.
var hasCLMUL = cpu.X86.HasAVX512F && cpu.X86.HasAVX512VPCLMULQDQ

// foldCLMUL folds p (a non-zero multiple of 256 bytes), with init xored
// into its first 4 bytes, into the 64 bytes out that have the same
// remainder modulo the CRC-32C polynomial. k is foldKeys.
//
//go:noescape
func foldCLMUL(out *[64]byte, p []byte, init uint32, k *[4]uint64)
