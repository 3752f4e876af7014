package bench

import (
	"errors"
	"fmt"
	"math/rand/v2"
)

// ErrMismatch means a loaded block does not hold the bytes its key was stored
// from, or a missed key's block was written.
var ErrMismatch = errors.New("bench: loaded bytes differ")

// Poison is the byte every destination block is set to before a load.
const Poison = 0xA5

// Memory is where the paged cache lives (GPU or host memory), seen from
// the host: the benchmark fills it, poisons it and reads it back to check.
type Memory interface {
	// WriteAt copies p into the memory at off.
	WriteAt(p []byte, off int64) error
	// ReadAt copies the memory at off into p.
	ReadAt(p []byte, off int64) error
}

// Layout is the paged cache of a benchmark: per layer, NumBlocks pages of
// PageBytes (vLLM's page: the K block then the V block), one layer after
// the other. The lower half of the pages are sources: key i is stored from
// the pages Src[i], scattered at random; the upper half are destinations:
// key i is loaded into Dst[i]. No page serves two keys, so every load can
// be checked byte for byte after the phase.
type Layout struct {
	Layers       int     // layers, one after the other in memory
	PageBytes    int64   // bytes of one page (the K block then the V block)
	BlocksPerKey int     // pages of one key in each layer
	Keys         int     // keys laid out, one entry each in Src and Dst
	NumBlocks    int     // pages per layer: 2 × Keys × BlocksPerKey
	Src, Dst     [][]int // per key, the BlocksPerKey pages it is stored from (lower half) and loaded into (upper half)
}

// NewLayout scatters keys × blocksPerKey source pages and as many
// destination pages at random (seeded, so runs repeat).
func NewLayout(layers int, pageBytes int64, blocksPerKey, keys int, seed uint64) *Layout {
	n := keys * blocksPerKey
	r := rand.New(rand.NewPCG(seed, 0x6b76686f7374))
	src, dst := r.Perm(n), r.Perm(n)
	l := &Layout{Layers: layers, PageBytes: pageBytes, BlocksPerKey: blocksPerKey, Keys: keys, NumBlocks: 2 * n}
	for i := range keys {
		s, d := make([]int, blocksPerKey), make([]int, blocksPerKey)
		for j := range blocksPerKey {
			s[j] = src[i*blocksPerKey+j]
			d[j] = n + dst[i*blocksPerKey+j]
		}
		l.Src, l.Dst = append(l.Src, s), append(l.Dst, d)
	}
	return l
}

// LayerBytes is one layer's tensor.
func (l *Layout) LayerBytes() int64 { return int64(l.NumBlocks) * l.PageBytes }

// Bytes is the whole cache.
func (l *Layout) Bytes() int64 { return int64(l.Layers) * l.LayerBytes() }

// destBytes is one layer's destination half.
func (l *Layout) destBytes() int64 { return int64(l.NumBlocks/2) * l.PageBytes }

// Fill writes random bytes into every source page of mem and returns the
// sources as stored (one image of each layer's source half).
func (l *Layout) Fill(mem Memory, seed uint64) ([][]byte, error) {
	r := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16), byte(seed >> 24), 'k', 'v'})
	src := make([][]byte, l.Layers)
	for layer := range l.Layers {
		b := make([]byte, l.destBytes())
		r.Read(b)
		if err := mem.WriteAt(b, int64(layer)*l.LayerBytes()); err != nil {
			return nil, fmt.Errorf("bench: fill layer %d: %w", layer, err)
		}
		src[layer] = b
	}
	return src, nil
}

// Poison sets every destination page of mem to Poison.
func (l *Layout) Poison(mem Memory) error {
	b := make([]byte, l.destBytes())
	for i := range b {
		b[i] = Poison
	}
	for layer := range l.Layers {
		if err := mem.WriteAt(b, int64(layer)*l.LayerBytes()+l.destBytes()); err != nil {
			return fmt.Errorf("bench: poison layer %d: %w", layer, err)
		}
	}
	return nil
}

// Verify reads the destination pages back from mem and checks, for key i
// with loaded[i], that each holds the source page it was stored from, and
// for a key without, that its pages still hold Poison. It returns the bytes
// it compared; a difference is an error wrapping ErrMismatch that names the
// key, layer and block.
func (l *Layout) Verify(mem Memory, src [][]byte, keys []int, loaded []bool) (int64, error) {
	b := make([]byte, l.destBytes())
	var checked int64
	half := l.NumBlocks / 2
	for layer := range l.Layers {
		if err := mem.ReadAt(b, int64(layer)*l.LayerBytes()+l.destBytes()); err != nil {
			return checked, fmt.Errorf("bench: read back layer %d: %w", layer, err)
		}
		for n, k := range keys {
			for j := range l.BlocksPerKey {
				got := b[int64(l.Dst[k][j]-half)*l.PageBytes:][:l.PageBytes]
				if loaded[n] {
					want := src[layer][int64(l.Src[k][j])*l.PageBytes:][:l.PageBytes]
					if string(got) != string(want) {
						return checked, fmt.Errorf("%w: key %d layer %d block %d (page %d)", ErrMismatch, k, layer, j, l.Dst[k][j])
					}
				} else {
					for _, c := range got {
						if c != Poison {
							return checked, fmt.Errorf("%w: key %d was a miss, but layer %d block %d (page %d) was written", ErrMismatch, k, layer, j, l.Dst[k][j])
						}
					}
				}
				checked += l.PageBytes
			}
		}
	}
	return checked, nil
}

// Hit says whether key i of n is one of the loads that find their key,
// spreading round(ratio × n) hits evenly.
func Hit(i int, ratio float64) bool {
	if ratio >= 1 {
		return true
	}
	if ratio <= 0 {
		return false
	}
	return int(float64(i+1)*ratio) > int(float64(i)*ratio)
}
