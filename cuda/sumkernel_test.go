package cuda

import (
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/internal/crc32c"
)

// emulateSumKernel runs the checksum kernel's steps for one span in Go,
// with the tables the PTX carries: each thread's rounds, then the
// reduction.
func emulateSumKernel(data []byte) uint32 {
	t := sumTables()
	lookup := func(g int, r uint32) uint32 {
		base := g * sumGroupWords
		return t[base+int(r&0xff)] ^ t[base+256+int(r>>8&0xff)] ^ t[base+512+int(r>>16&0xff)] ^ t[base+768+int(r>>24)]
	}
	le := func(b []byte) uint32 { return uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24 }
	n := len(data)
	plen := (n + sumRound - 1) &^ (sumRound - 1)
	pad := plen - n
	var red [sumThreads]uint32
	for thr := range sumThreads {
		var acc uint32
		for pos := thr * 16; pos < plen; pos += sumRound {
			if pos < pad {
				continue
			}
			w := data[pos-pad : pos-pad+16]
			acc = lookup(1, acc)
			for k := range 4 {
				acc = lookup(0, acc^le(w[4*k:]))
			}
		}
		red[thr] = acc
	}
	for l := range sumLevels {
		for thr := 0; thr < sumThreads; thr += 2 << l {
			red[thr] = lookup(2+l, red[thr]) ^ red[thr+1<<l]
		}
	}
	return red[0]
}

// TestSumKernelAlgorithm: the kernel's steps and tables give the register
// crc32c.Register gives, for spans of one 16-byte word up to SumMaxLen,
// whole rounds and partial ones.
func TestSumKernelAlgorithm(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	data := make([]byte, SumMaxLen)
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	for _, n := range []int{16, 32, 4080, sumRound, sumRound + 16, 3*sumRound - 48, 32 << 10, SumMaxLen - 16, SumMaxLen} {
		if got, want := emulateSumKernel(data[:n]), crc32c.Register(data[:n]); got != want {
			t.Errorf("%d bytes: kernel's steps %#x, Register %#x", n, got, want)
		}
	}
}

// TestSumKernelPTXCarriesItsTables: the PTX defines the entry the loader
// looks for and every table word.
func TestSumKernelPTXCarriesItsTables(t *testing.T) {
	ptx := sumKernelPTX()
	if !strings.Contains(ptx, ".entry "+sumKernelName+"(") {
		t.Fatalf("no entry %s", sumKernelName)
	}
	if got := strings.Count(ptx, "0x") - strings.Count(ptx, "and.b32 plen, plen, 0x"); got != sumTableWords {
		t.Fatalf("%d table words in the PTX, want %d", got, sumTableWords)
	}
}
