#include "textflag.h"

// FOLD folds the sixteen bytes of each 128-bit lane of X onto DATA with
// the keys K (per lane: lo, hi), using T as scratch:
// X = clmul(X.lo, K.lo) ^ clmul(X.hi, K.hi) ^ DATA, lane by lane.
#define FOLD(X, K, T, DATA) \
	VPCLMULQDQ $0x11, K, X, T; \
	VPCLMULQDQ $0x00, K, X, X; \
	VPTERNLOGQ $0x96, DATA, T, X

// func foldCLMUL(out *[64]byte, p []byte, init uint32, k *[4]uint64)
TEXT ·foldCLMUL(SB), NOSPLIT, $0-48
	MOVQ out+0(FP), DI
	MOVQ p_base+8(FP), SI
	MOVQ p_len+16(FP), CX
	MOVL init+32(FP), AX
	MOVQ k+40(FP), BX

	VMOVDQU64 0(SI), Z0
	VMOVDQU64 64(SI), Z1
	VMOVDQU64 128(SI), Z2
	VMOVDQU64 192(SI), Z3
	VMOVQ AX, X4
	VPXORQ Z4, Z0, Z0
	ADDQ $256, SI
	SUBQ $256, CX
	VBROADCASTI32X4 0(BX), Z8

loop:
	CMPQ CX, $0
	JEQ reduce
	VMOVDQU64 0(SI), Z10
	VMOVDQU64 64(SI), Z11
	VMOVDQU64 128(SI), Z12
	VMOVDQU64 192(SI), Z13
	FOLD(Z0, Z8, Z4, Z10)
	FOLD(Z1, Z8, Z5, Z11)
	FOLD(Z2, Z8, Z6, Z12)
	FOLD(Z3, Z8, Z7, Z13)
	ADDQ $256, SI
	SUBQ $256, CX
	JMP loop

reduce:
	VBROADCASTI32X4 16(BX), Z8
	FOLD(Z0, Z8, Z4, Z1)
	FOLD(Z0, Z8, Z4, Z2)
	FOLD(Z0, Z8, Z4, Z3)
	VMOVDQU64 Z0, 0(DI)
	VZEROUPPER
	RET
