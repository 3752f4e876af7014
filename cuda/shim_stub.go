//go:build !linux || !cgo

package cuda

import "unsafe"

// Loadable reports whether this build can load the CUDA runtime at all:
// false without cgo (CGO_ENABLED=0, or no C compiler at build time) or
// off Linux, where the binary serves host memory only.
const Loadable = false

// Without cgo no library can be opened (Open fails first), so none of
// these is ever reached; each fails as a missing library would.

const stubCode = 35 // cudaErrorInsufficientDriver

func callP(f, a unsafe.Pointer) int                                  { return stubCode }
func callU(f unsafe.Pointer, a uintptr) int                          { return stubCode }
func callI(f unsafe.Pointer, a int) int                              { return stubCode }
func callPU(f, a unsafe.Pointer, b uint32) int                       { return stubCode }
func callUU(f unsafe.Pointer, a, b uintptr) int                      { return stubCode }
func callPSU(f, a unsafe.Pointer, b uintptr, c uint32) int           { return stubCode }
func callUSU(f unsafe.Pointer, a, b uintptr, c uint32) int           { return stubCode }
func callPS(f, a unsafe.Pointer, b uintptr) int                      { return stubCode }
func callPII(f, a unsafe.Pointer, b, c int) int                      { return stubCode }
func callPPU(f, a, b unsafe.Pointer, c uintptr) int                  { return stubCode }
func callPA(f, a unsafe.Pointer, b uintptr) int                      { return stubCode }
func callPI(f, a unsafe.Pointer, b int) int                          { return stubCode }
func callStr(f unsafe.Pointer, e int) string                         { return "" }
func callMemcpy(f unsafe.Pointer, dst, src, n uintptr, kind int) int { return stubCode }
func callMemcpyAsync(f unsafe.Pointer, dst, src, n uintptr, kind int, s uintptr) int {
	return stubCode
}
func memcpyMany(f unsafe.Pointer, dsts, srcs, sizes []uintptr, kind int, s uintptr) (int, int) {
	return 0, stubCode
}
func memcpyBatch(f unsafe.Pointer, v13 bool, dsts, srcs, sizes []uintptr, s uintptr) int {
	return stubCode
}
func ipcOpen(f unsafe.Pointer, h *[IPCHandleSize]byte, flags uint32) (uintptr, int) {
	return 0, stubCode
}
func moduleLoad(f unsafe.Pointer, image string) (uintptr, string, int) { return 0, "", stubCode }
func moduleFunction(f unsafe.Pointer, mod uintptr, name string) (uintptr, int) {
	return 0, stubCode
}
func launchU64(f unsafe.Pointer, fn uintptr, gx, gy, bx uint32, s uintptr, arg uint64) int {
	return stubCode
}
