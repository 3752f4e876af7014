// Command go-policy is a complete third-party kvhost placement policy in one
// directory: "size-first" eviction, which frees space with the fewest
// deletions by evicting the largest unpinned files first. It is what a
// storage vendor starts from when writing a policy in Go.
//
// Build it into a plugin module with
//
//	GOOS=wasip1 GOARCH=wasm go build -trimpath -buildmode=c-shared -o policy.wasm .
//
// and run kvhost with `--policy policy.wasm`. The policy is an ordinary Go
// type implementing guest.Policy; init registers it, and the SDK (package
// abi/guest) provides every wasm export. Natively, guest.Register does
// nothing and the tests drive the same type through guest.NewDispatcher.
//
// Names are <fingerprint in hex>_r<rank>/<key as hex>.kv on mount 0: only
// record fields that are the same on every node (never the host-assigned
// namespace id), so that nodes sharing a file system agree on names.
package main

import (
	"encoding/hex"
	"slices"
	"strconv"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
)

func init() { guest.Register(NewPolicy()) }

// main is empty: a c-shared wasm module is driven through its exports.
func main() {}

// entry is what the policy remembers about one stored file.
type entry struct {
	id    uint64
	size  uint64
	mount uint32
	pins  uint32
}

// Policy is the size-first policy.
type Policy struct {
	entries []entry        // unordered; removal swaps with the last
	index   map[uint64]int // entry id -> position in entries
	order   []int          // reused by Evict: candidate positions
}

// NewPolicy returns an empty size-first policy.
func NewPolicy() *Policy { return &Policy{index: map[uint64]int{}} }

// Init accepts any configuration: this policy has no settings.
func (p *Policy) Init(guest.Config) error { return nil }

// Name writes <fingerprint>_r<rank>/<key hex>.kv into each record, appending
// to the record's own path buffer so that naming allocates nothing.
func (p *Policy) Name(recs []abi.NameRecord) error {
	for i := range recs {
		r := &recs[i]
		b := r.PathBuf[:0]
		b = strconv.AppendUint(b, r.Fingerprint, 16)
		b = append(b, "_r"...)
		b = strconv.AppendUint(b, uint64(r.TPRank), 10)
		b = append(b, '/')
		if r.KeyLen == 0 {
			b = append(b, '_') // a file name must not start with '.'
		}
		b = hex.AppendEncode(b, r.Key())
		b = append(b, ".kv"...)
		r.PathLen = uint32(len(b))
		r.Mount = 0
	}
	return nil
}

// Access tracks inserts, pins and removals. Hits change nothing: size-first
// does not care how recently a file was used.
func (p *Policy) Access(recs []abi.AccessRecord) error {
	for i := range recs {
		r := &recs[i]
		pos, known := p.index[r.Entry]
		switch r.Kind {
		case abi.AccessInsert, abi.AccessHit, abi.AccessRestore, abi.AccessPin:
			if !known {
				pos = len(p.entries)
				p.entries = append(p.entries, entry{id: r.Entry})
				p.index[r.Entry] = pos
			}
			e := &p.entries[pos]
			switch {
			case r.Kind == abi.AccessPin:
				e.pins++
			case r.Kind != abi.AccessHit || !known:
				// Hits need not repeat the size and mount of the insert.
				e.size, e.mount = r.Size, r.Mount
			}
		case abi.AccessUnpin:
			if known && p.entries[pos].pins > 0 {
				p.entries[pos].pins--
			}
		case abi.AccessRemove:
			if known {
				last := len(p.entries) - 1
				p.entries[pos] = p.entries[last]
				p.index[p.entries[pos].id] = pos
				p.entries = p.entries[:last]
				delete(p.index, r.Entry)
			}
		default:
			return guest.InvalidInput("unknown access kind " + strconv.FormatUint(uint64(r.Kind), 10))
		}
	}
	return nil
}

// Evict returns the largest unpinned entries on the requested mount until
// their sizes cover req.Bytes. Score is the bitwise complement of the size,
// so that the host's ascending-score merge also puts the largest first.
func (p *Policy) Evict(req *abi.EvictRequest, out []abi.Victim) (int, error) {
	p.order = p.order[:0]
	for i, e := range p.entries {
		if e.pins == 0 && (req.Mount == abi.AnyMount || req.Mount == e.mount) {
			p.order = append(p.order, i)
		}
	}
	slices.SortFunc(p.order, func(a, b int) int {
		ea, eb := &p.entries[a], &p.entries[b]
		switch {
		case ea.size != eb.size:
			if ea.size > eb.size {
				return -1
			}
			return 1
		case ea.id < eb.id:
			return -1
		case ea.id > eb.id:
			return 1
		}
		return 0
	})
	n, freed := 0, uint64(0)
	for _, i := range p.order {
		if n == len(out) || freed >= req.Bytes {
			break
		}
		e := &p.entries[i]
		out[n] = abi.Victim{Entry: e.id, Score: ^e.size}
		n++
		freed += e.size
	}
	return n, nil
}
